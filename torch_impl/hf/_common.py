"""What the modules of torch_impl.hf share: the registered implementation's name, the forward's
CP context that the model's pre-hook makes for its mask function, reading a forward's arguments
by name in hooks, fetching a layer's keys and values (`fetch_kv`), and the pieces of the dense
path: a chunk's queries in blocks, which keys they see, the model's attention on that mask."""

from contextlib import contextmanager
import inspect
from typing import NamedTuple

import torch

from torch_impl.halo import gather_halo
from torch_impl.layout import Documents, ShardPlan
from torch_impl.sequence import gather_sequence

IMPLEMENTATION = "cp_transport"
INDEXED = "indexed_attention"  # an indexer's top-k: DeepSeek Sparse Attention (MLA), Qwen4's QSA
LINEAR = "linear_attention"  # the layer type of the recurrences torch_impl.hf.recurrent runs
SLIDING = "sliding_attention"


class Context(NamedTuple):
    """One forward of a parallelized model on this rank, made once by its pre-hook
    (torch_impl.hf.inputs) and held in RUNNING while the model runs: the mask function reads it
    and puts what each kind of layer needs in the mask it makes, which transformers hands every
    attention layer of that kind."""

    owner: int  # which parallelized model made it (the model's id)
    group: object  # the CP ProcessGroup
    shard: ShardPlan  # which global rows this rank holds
    documents: Documents | None  # packed rows' documents, by global row
    chunks: Documents | None  # chunked-attention layers' attention chunks (within documents)
    padding: torch.Tensor | None  # the attention_mask by global row, bool [B, S]; None: none given
    kinds: frozenset | None  # the attention layer types the model has; None: any mask it makes
    images: "Images | None" = None  # images whose tokens see each other (Gemma 3's, 4's); None: none


class Images(NamedTuple):
    """A batch's images whose tokens see every token of their image (Gemma 3's, 4's), the same on every
    CP rank (from the gathered token types), made once per forward (torch_impl.hf.media.images)."""

    ids: torch.Tensor  # int [B, S] by global row: each token's image, -1 for text
    ahead: tuple  # per global chunk, how far past its end the image holding its last token runs on
    seeing: frozenset  # the global chunks holding image tokens (in any row)
    full: bool = True  # whether full-attention layers see them too (Gemma 4's: sliding layers only)


class Aside(NamedTuple):
    """A forward of a parallelized model given a batch that `shard_batch` did not make (the whole
    sequence on every rank: `generate`, with or without a cache, a quick forward): it runs as one
    process would. Every CP path steps aside (the model's own mask and attention functions, convs
    and kernels) and nothing is communicated, so the ranks may run such calls independently."""

    owner: int  # which parallelized model's forward it is (the model's id)
    make_mask: object  # the model's own mask function (transformers' sdpa_mask or eager_mask)


def stepping_aside():
    """Whether the running forward is an `Aside` one (an unsharded call: as one process)."""
    return isinstance(RUNNING.context, Aside)


MIXED_CLASSES = {}


def mix(module, mixin):
    """The module, its class swapped for `mixin` mixed into its own (its parameters keep their names)."""
    cls = type(module)
    if (mixin, cls) not in MIXED_CLASSES:
        MIXED_CLASSES[mixin, cls] = type(f"CP{cls.__name__}", (mixin, cls), {})
    module.__class__ = MIXED_CLASSES[mixin, cls]
    return module


class Running:
    """The Context of the parallelized forward that is running (an Aside for an unsharded one; None
    outside one): set by its pre-hook, restored by its forward hook. A plain attribute, which
    torch.compile traces (it does not trace a ContextVar)."""

    context = None


RUNNING = Running()


@contextmanager
def in_context(context, inner):
    """`inner` (a context manager) entered with RUNNING.context set to `context`; the Context that
    was running is restored after."""
    outer, RUNNING.context = RUNNING.context, context
    try:
        with inner:
            yield
    finally:
        RUNNING.context = outer


class Arguments:
    """A forward's arguments by name, whether passed by position or keyword, for forward pre-hooks."""

    def __init__(self, forward):
        parameters = inspect.signature(forward).parameters
        self.names = list(parameters)
        self.varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    def get(self, args, kwargs, name):
        i = self.names.index(name) if name in self.names else len(args)
        return args[i] if i < len(args) else kwargs.get(name)

    def replace(self, args, kwargs, **values):
        """(args, kwargs) with the named arguments set to new values, where they were passed."""
        args, kwargs = list(args), dict(kwargs)
        for name, value in values.items():
            if name not in self.names and not self.varkw:
                raise ValueError(f"torch_impl.hf: the forward takes no argument {name!r}: {self.names}")
            i = self.names.index(name) if name in self.names else len(args)  # else one of its **kwargs
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs


def check_stateless(args, *given):
    """ValueError where a kernel was given more positional arguments than its CP version knows, or
    any of `given` (an initial state, a request for the final state, cu_seqlens / seq_idx) is set."""
    if args or any(value is not None and value is not False for value in given):
        raise ValueError(
            "torch_impl.hf: a linear-attention layer was called with a recurrent state, for its final "
            "state or with cu_seqlens / seq_idx: generation with a cache and flash-style packed "
            "sequences are not supported under CP"
        )


def fetch_kv(context, key, value, reach, lookahead=0):
    """This rank's keys and values for a layer of this reach (key [B, Hkv, L, D], value [B, Hkv, L,
    Dv]), in one exchange: packed side by side into one sequence-major buffer [L, B, Hkv, D + Dv]
    (the copy the transport makes anyway), then the causal prefix gathered (reach None:
    gather_sequence, the sequence in global order) or each chunk's reach fetched (gather_halo, one
    segment per chunk: its tokens before it, then itself), and split back. Backward: the two
    gradients packed the same way, one reduce-scatter or one set of p2p messages. `lookahead`: the
    tokens after each chunk a halo also fetches (an image's rest; the gathered sequence has them).
    Returns (key [B, Hkv, T, D], value [B, Hkv, T, Dv])."""
    shard, group, D = context.shard, context.group, key.shape[-1]
    if value is key:  # one tensor for both (DeepSeek V4's shared KV): sent once
        key, _ = fetch_kv(context, key, key[..., :0], reach, lookahead)
        return key, key
    packed = torch.cat([key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)], dim=-1)  # [L, B, Hkv, D + Dv]
    packed = packed.transpose(0, 1)  # [B, L, Hkv, D + Dv]: a view the transport takes without a copy
    if reach is None:
        packed = gather_sequence(packed, group, layout=shard.layout)  # [B, S, Hkv, D + Dv]
    else:
        packed = gather_halo(packed, group, reach, layout=shard.layout, lookahead=lookahead)
        # [B, T, Hkv, D + Dv]: each chunk's reach, the chunk and its lookahead
    key, value = packed.split([D, packed.shape[-1] - D], dim=-1)  # [B, T, Hkv, D], [B, T, Hkv, Dv]
    return key.transpose(1, 2), value.transpose(1, 2)


def query_blocks(mask, block):
    """A LocalMask's queries, `block` at a time per local chunk: (its ChunkKeys, the block's global
    rows, their local rows, the columns of the chunk's keys that the block reaches: causal, and
    within the window where the layer has one)."""
    for keys in mask.chunks:
        w = keys.chunk
        for q0 in range(w.start, w.end, block):
            q1 = min(q0 + block, w.end)
            k0 = w.first_key if mask.window is None else max(w.first_key, q0 - mask.window + 1)
            local = slice(w.queries.start + q0 - w.start, w.queries.start + q1 - w.start)
            yield keys, range(q0, q1), local, slice(k0 - w.first_key, q1 - w.first_key)


def window_rule(keys, window, queries, cut, device):
    """bool [B or 1, q, k]: a full (window None) or sliding layer's rule for queries at global rows
    `queries` over the keys of ChunkKeys columns `cut`: causal, within the window, not padding, the
    same document."""
    first = keys.chunk.first_key
    q = torch.arange(queries.start, queries.stop, device=device)[:, None]
    k = torch.arange(first + cut.start, first + cut.stop, device=device)[None]
    seen = (k <= q)[None]  # [1, q, k]
    if window is not None:
        seen = seen & (q - k < window)
    if keys.padding is not None:
        seen = seen & keys.padding[:, None, cut]
    if keys.documents is not None:
        own = keys.documents[:, queries.start - first : queries.stop - first]  # [B, q]
        seen = seen & (keys.documents[:, None, cut] == own[:, :, None])
    return seen


def attend_visible(module, query, key, value, visible, kwargs):
    """The model's own attention function (module.context_parallel's) for query [B, H, q, D] over
    key / value [B, Hkv, k, D] on the dense mask that `visible` (bool [B, q, k]) makes."""
    setup, B = module.context_parallel, query.shape[0]
    dense = setup.make_mask(
        batch_size=B,
        q_length=visible.shape[1],
        kv_length=visible.shape[2],
        mask_function=lambda b, h, q, kv: visible[b, q, kv],
        allow_is_causal_skip=False,
        dtype=query.dtype,
        device=query.device,
        config=module.config,
    )  # [B, 1, q, k]
    return setup.attend(module, query, key, value, dense, **kwargs)


def by_document(run, first, window, reach):
    """A local chunk's outputs [B, C, ...] from a layer's own forward that reads `reach` rows back:
    `run(b, begin, stop)` runs it over global rows [begin, stop) of batch rows b (a slice) and
    returns [b, stop - begin, ...]. Where no document begins within reach of the chunk (`first`:
    int [B, S], each token's document start by global row; None: no documents), one run over the
    chunk's window; else, per row, one run per piece of a document, from its start or `reach`
    rows before the piece, whichever is later, so that nothing before a document's start is read."""
    w, C = window, window.end - window.start
    starts = None if first is None else first[:, w.start : w.end]  # [B, C]
    if starts is None or bool((starts <= w.first_key).all()):
        return run(slice(None), w.first_key, w.end)[:, -C:]
    rows = []
    for b, row in enumerate(starts.tolist()):
        cuts = [t for t in range(C) if t == 0 or row[t] == w.start + t] + [C]
        pieces = [
            run(slice(b, b + 1), max(row[lo], w.start + lo - reach), w.start + hi)[:, -(hi - lo) :]
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)
