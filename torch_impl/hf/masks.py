"""The registered mask function of full, sliding-window and chunked attention layers, whose masks
torch_impl.hf.attention attends with: once per forward and kind of layer, `local_mask` makes a
`LocalMask` from the forward's `Context`: how far back that kind's keys reach (full: the causal
prefix; a window W: W - 1; packed documents or attention chunks: each chunk's reach back to its
document's or attention chunk's start) and, per chunk the rank holds (torch_impl.layout.ShardPlan:
one contiguous, two under head_tail), which rows of the fetched keys it attends over and their
padding, cut from the padding the pre-hook gathered once per forward (a mask function communicates
nothing: some models make their masks in an order that differs between processes). Where image
tokens see every token of their image (Gemma 3's and 4's; the Context's Images), a chunk's keys run on past
its end as far as its last token's image (the LocalMask's lookahead) and carry their image ids."""

from typing import NamedTuple

import torch
from transformers.masking_utils import AttentionMaskInterface

from torch_impl.hf._common import IMPLEMENTATION, RUNNING, Aside, Context
from torch_impl.layout import Window


class ChunkKeys(NamedTuple):
    """One local chunk's keys for a kind of layer: its ShardPlan Window (queries at global rows
    [start, end), keys at [first_key, end + after)), those keys' rows in what `fetch_kv` returns,
    and their padding (bool [B, T], True: a token), document ids (int [B, T]) and, where some of
    the chunk's queries (in any row) are image tokens that see their whole image, image ids (int
    [B, T], -1: text), or None; with documents, the global row where each of its queries' document
    begins (int [B, C], the Documents' first rows: the CPU tiles plan from them)."""

    chunk: Window
    rows: slice
    padding: torch.Tensor | None
    documents: torch.Tensor | None
    blocks: torch.Tensor | None = None
    starts: torch.Tensor | None = None


class LocalMask(NamedTuple):
    """What this implementation's mask function makes once per forward for each kind of layer, and
    the model routes to those layers: how far back their keys reach, and per local chunk which keys
    its queries see, with their padding and documents (cut from the forward's Context)."""

    context: Context  # the forward's, from the model's pre-hook
    window: int | None  # sliding window W (a query sees W keys, itself included); None: none
    reach: int | tuple | None  # ShardPlan.windows' reach: None the causal prefix, else per chunk
    chunks: tuple  # ChunkKeys per local chunk; none for a kind of layer the model does not have
    lookahead: int | tuple = 0  # per global chunk, the tokens after it its images reach


# --- the registered mask function ----------------------------------------------------------------


def local_mask(**kwargs):
    """The registered mask function: a LocalMask (`shard_mask`), or in an unsharded call (Aside) the
    model's own mask function's mask."""
    if isinstance(RUNNING.context, Aside):
        return RUNNING.context.make_mask(**kwargs)
    return shard_mask(**kwargs)


def shard_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    use_vmap=False,
    **kwargs,
):
    """transformers calls this once per forward per mask kind; the math waits for the gathered keys.
    Called inside the model's forward, after its pre-hook made the forward's Context."""
    context = RUNNING.context
    if context is None:
        raise ValueError(
            "torch_impl.hf: the model's masks were made without the CP context that "
            "torch_impl.hf.parallelize's pre-hook makes: the model was called through a module the "
            "adapter did not hook, so its positions and padding would be this rank's alone"
        )
    if q_offset != 0 or kv_offset != 0 or kv_length != q_length:
        raise ValueError(
            f"torch_impl.hf: `{IMPLEMENTATION}` cannot attend over a KV cache (generation): the model "
            f"asked for {q_length} queries over {kv_length} keys at offsets {q_offset}, {kv_offset}"
        )
    if use_vmap:
        raise ValueError(
            f"torch_impl.hf: `{IMPLEMENTATION}` supports causal and sliding-window masks (and packed "
            "sequences) only: this model asked for a mask overlay (bidirectional or blockwise tokens, "
            "or a non-causal config)"
        )
    chunked = local_size is not None and local_size == getattr(
        kwargs.get("config"), "attention_chunk_size", None
    )
    window = None if chunked else local_size
    kind = "chunked_attention" if chunked else "full_attention" if window is None else "sliding_attention"
    if context.kinds is not None and kind not in context.kinds:  # made for the mapping, used by none
        return LocalMask(context, window, None, ())
    documents = context.chunks if chunked else context.documents
    return make_mask(context, attention_mask, window, documents)


def make_mask(context, attention_mask, window, documents):
    """The LocalMask of one kind of layer: the keys' reach (a window W: W - 1; full: the causal
    prefix; documents: back to the start of the document holding each chunk's first token, which
    inside torch.compile is not read: no graph per batch) and each chunk's keys' padding, from the
    padding the pre-hook gathered (no communication here: the order in which a model makes its
    masks may differ between processes). attention_mask: the model's [B, L] mask, or None."""
    reach = None if window is None else window - 1
    if documents is not None and documents.reach is not None:
        reach = documents.layer_reach(window)
    if attention_mask is not None and context.padding is None:
        raise ValueError(
            "torch_impl.hf: the model made its masks from an attention_mask that its inputs did "
            "not have, whose other shards this rank cannot know"
        )
    padding = None if attention_mask is None else context.padding  # bool [B, S]
    images = context.images
    if images is not None and window is None and not images.full:  # plain causal on full layers
        images = None
    first = None if documents is None else documents.first_rows()  # [B, S]
    ahead = 0 if images is None else images.ahead  # per global chunk: its images' tokens after it
    chunks = tuple(
        ChunkKeys(
            w,
            rows,
            None if padding is None else padding[:, w.keys],  # [B, T]
            None if documents is None else documents.ids[:, w.keys],  # [B, T]
            images.ids[:, w.keys] if images is not None and w.chunk in images.seeing else None,  # [B, T]
            None if first is None else first[:, w.start : w.end],  # [B, C]
        )
        for w, rows in _key_rows(context.shard, reach, ahead)
    )
    return LocalMask(context, window, reach, chunks, ahead)


def _key_rows(shard, reach, lookahead=0):
    """Per local chunk (Window, its keys' rows in what a fetch of this reach returns): the gathered
    sequence's rows [first_key, end + after), or gather_halo's segment."""
    if reach is None:
        return tuple((w, w.keys) for w in shard.windows(lookahead=lookahead))
    return tuple((w, w.segment) for w in shard.windows(reach, lookahead=lookahead))


AttentionMaskInterface.register(IMPLEMENTATION, local_mask)
