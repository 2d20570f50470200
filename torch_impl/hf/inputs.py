"""The model's inputs under CP, as `shard_batch` (torch_impl.hf.batch) made them: the base model's
forward pre-hook (`ModelInputs`: global positions, packed documents, DSA's context, the refusals
(torch_impl.hf.input_checks) and the cross-rank check)."""

from functools import partial

import torch
import torch.nn.functional as F

from torch_impl import _group, validation
from torch_impl.hf import input_checks, media
from torch_impl.hf._common import INDEXED, LINEAR, RUNNING, SLIDING, Arguments, Aside, Context
from torch_impl.hf.batch import LAYOUT, TYPE_KEYS
from torch_impl.hf.documents import creates_cache as _creates_cache
from torch_impl.hf.indexed import IndexedContext
from torch_impl.hf.masks import make_mask
from torch_impl.layout import Documents, ShardPlan, document_starts, packed_ids, reach_of
from torch_impl.metadata import gather_metadata


class Positions:
    """The position_ids a model makes itself when it is given none, made over the whole sequence:
    most families count every token (the global rows); `PaddingIndexPositions` and
    `MaskCountPositions` count real tokens. Called with this rank's global rows [1, L] and, where
    `needs_ids` / `needs_padding`, the gathered input_ids / attention_mask [B, S] (or None when
    the model was not given them); returns [B or 1, L]."""

    needs_ids = needs_padding = False

    def __call__(self, rows, ids, padding):
        return rows


class PaddingIndexPositions(Positions):
    """The RoBERTa family's: the model's own `create_position_ids_from_input_ids` (padding_idx + the
    count of non-padding tokens up to each one; padding_idx at a padding token), and for
    inputs_embeds, padding_idx + 1 + the row."""

    needs_ids = True

    def __init__(self, embeddings):
        self.embeddings = embeddings

    def __call__(self, rows, ids, padding):
        pad = self.embeddings.padding_idx
        if ids is None:
            return rows + pad + 1
        return self.embeddings.create_position_ids_from_input_ids(ids, pad)[:, rows[0]]  # [B, L]


class MaskCountPositions(Positions):
    """OPT's: the count of real tokens before each one, cumsum(mask) * mask - 1."""

    needs_padding = True

    def __call__(self, rows, ids, padding):
        if padding is None:
            return rows
        count = padding.long().cumsum(dim=1)  # [B, S]
        return (count * padding - 1).long()[:, rows[0]]  # [B, L]


def chunk_ids(chunk, padding, documents, positions, B, S, device):
    """int64 [B, S]: runs of equal ids, one per attention chunk of `chunk` tokens, as transformers'
    chunked mask counts them: from each row's first real token (padding: bool [B, S] or None), or
    in packed rows (documents' ids and their gathered positions [B, S]) from each document's start."""
    if documents is not None:
        within = torch.div(positions, chunk, rounding_mode="floor")  # [B, S]
        starts = (within[:, 1:] != within[:, :-1]) | (documents[:, 1:] != documents[:, :-1])
        return F.pad(starts.long(), (1, 0)).cumsum(dim=1)  # [B, S]
    left = torch.zeros(B, dtype=torch.long, device=device)
    if padding is not None:
        left = (padding.long().cumsum(dim=-1) == 0).sum(dim=-1)  # [B]: each row's left padding
    return torch.div(torch.arange(S, device=device)[None] - left[:, None], chunk, rounding_mode="floor")


def _documents(documents, chunks, chunk_len):
    """(Documents or None, Documents or None) from packed rows' ids and attention chunks' ids (int
    [B, S], or None), with their per-chunk reach, in one host read per forward; packed rows in which
    no position restarts have no documents (transformers finds none). Inside torch.compile nothing
    is read (it would recompile for every batch): the ids with reach None (layers then take their
    windows' reach)."""
    if torch.compiler.is_compiling():
        documents = None if documents is None else Documents(documents, None, document_starts(documents))
        return documents, None if chunks is None else Documents(chunks, None)
    given = [t for t in (documents, chunks) if t is not None]
    if not given:
        return None, None
    restarts = [] if documents is None else [documents[:, -1].amax()[None]]  # [1]: 0 if no row restarts
    values = torch.cat([reach_of(t, chunk_len) for t in given] + restarts).tolist()  # the one read
    n = (len(values) - len(restarts)) // len(given)  # chunks
    reaches = [tuple(values[i * n : (i + 1) * n]) for i in range(len(given))]
    if documents is not None:  # with their starts, once a forward: every recurrent layer reads them
        documents = Documents(documents, reaches.pop(0), document_starts(documents)) if values[-1] else None
    return documents, None if chunks is None else Documents(chunks, reaches.pop(0))


class ModelInputs:
    """A forward pre-hook on the module that receives the model's inputs (its base model, and the
    decoder inside it where the model calls that directly: the first of them that runs in a
    forward does the work), for what a rank cannot see in its own tokens.

    - position_ids: filled in, when absent, with what the model itself would compute over the
      whole sequence (`Positions`: the global rows, or for some families a count of real tokens
      gathered once per forward). Given positions may restart (packed sequences); where
      transformers then isolates the documents (no attention_mask, no cache, a model that hands its
      mask functions the positions: torch_impl.hf.documents.ISOLATES), the positions are gathered once per
      forward and their document ids, numbered as transformers' `find_packed_sequence_indices`
      numbers them over the whole sequence, and how far back each chunk's first document began
      (torch_impl.layout.Documents), reach every attention layer in the `Context`, which this
      hook holds in `RUNNING` until the module returns (`done`): the mask function puts it in the
      masks it makes. Layers then fetch only their documents' keys; chunked-attention layers
      (Llama 4) likewise their attention chunk's.
    - indexed_attention models get one `IndexedContext` as their mask, with the padding mask
      gathered once per forward ([B, S]) and the documents, and no cache; their linear-attention
      layers (Qwen4's) the rank's own rows of the attention_mask, as one process gives its, and
      their sliding layers (dots3's) the LocalMask of their window.
    - refused: a KV cache that already holds tokens (each rank's cache would hold its own keys),
      and any input besides a text batch's (pixel values, audio features, token type ids, ...).
    - a call whose kwargs `shard_batch` did not make (no `cp_layout`: the whole sequence on every
      rank, as `generate` and quick forwards pass it) runs as one process would (`Aside`): every CP
      path steps aside for it and nothing is communicated. In training mode with grad enabled it
      is refused (n > 1): there it is most likely a shard whose mark a loop dropped. (A rank that
      calls with a shard while another calls without waits for it in the cross-rank check: call
      alike on every rank.)
    - with `validate` (parallelize's default), the ranks first compare their inputs in one
      all-gather of a few integers (`input_checks.signature`): ranks given different shapes or
      arguments, or one whose own inputs were refused, raise ValueError on every rank instead of
      hanging or returning inconsistent shards. Skipped inside torch.compile (it reads the result
      on the host).
    """

    def __init__(
        self, module, *, owner, group, layout, validate, positions, isolates, kinds, make_mask, indexed, chunk
    ):
        self.group, self.arguments, self.indexed = group, Arguments(module.forward), indexed
        self.make_mask = make_mask  # the model's own mask function, for unsharded calls (Aside)
        self.validate, self.layout, self.owner = validate, layout, owner
        self.positions = positions  # the model's own default position_ids (Positions)
        self.chunk = chunk  # chunked attention's chunk size (Llama 4), or None
        self.isolates = isolates  # whether the model isolates packed documents (None: cannot tell)
        self.kinds = kinds  # the attention layer types the model has (None: not listed)
        self.window = getattr(module.config.get_text_config(), "sliding_window", None)  # its sliding layers'
        self.outer = []  # per forward this hook prepared, innermost last: the Context it replaced

    def __call__(self, module, args, kwargs):
        current = RUNNING.context
        if current is not None and current.owner == self.owner:  # an outer hooked module prepared it
            return None
        kwargs = dict(kwargs)
        given = kwargs.pop(LAYOUT, None)  # shard_batch's mark, naming the layout
        if given is None:  # not a shard: this forward runs as one process would
            if _group.world_size(self.group) > 1 and module.training and torch.is_grad_enabled():
                raise ValueError(
                    f"torch_impl.hf: {type(module).__name__} was called in training, with grad, "
                    "without the mark of a shard (`cp_layout`): a rank's shard would run as if it "
                    "were the whole row. Pass every key hf.shard_batch returns, `cp_layout` "
                    "included, to the model; a whole batch runs as one process in eval mode or "
                    "under torch.no_grad()"
                )
            self.outer.append(current)
            RUNNING.context = Aside(self.owner, self.make_mask)
            return None
        argument = partial(self.arguments.get, args, kwargs)
        error = self.refusal(module, argument, given)
        if error:
            raise ValueError(error)
        context, positions, changes = self.context(module, argument)
        self.outer.append(RUNNING.context)
        RUNNING.context = context
        padding = argument("attention_mask")
        if self.indexed:
            # the layers beside: linear attention (Qwen4's) masks its own rows' padding, as one
            # process; sliding layers (dots3's) take the mask this implementation's function makes
            masks = {INDEXED: IndexedContext(context), LINEAR: padding}
            if self.kinds is not None and SLIDING in self.kinds:
                masks[SLIDING] = make_mask(context, padding, self.window, context.documents)
            return self.arguments.replace(
                args,
                kwargs,
                attention_mask=masks,
                past_key_values=None,
                position_ids=positions,
                use_cache=False,
                **changes,
            )
        if "position_ids" not in self.arguments.names:  # a model without attention (Mamba)
            return args, kwargs
        return self.arguments.replace(args, kwargs, position_ids=positions, **changes)

    @staticmethod
    def tokens(argument):
        """The forward's input_ids [B, L] or inputs_embeds [B, L, D]."""
        tokens = argument("input_ids")
        return argument("inputs_embeds") if tokens is None else tokens

    def refusal(self, module, argument, given):
        """Why this rank's sharded inputs cannot run (the layout `given` by shard_batch, the
        refusals of input_checks' check and check_text), or None; with `validate`, after the ranks
        compared their inputs, so that every rank raises alike instead of one leaving the others
        waiting."""
        tokens, creates_cache = self.tokens(argument), _creates_cache(module, argument)
        error = input_checks.check(module, argument("past_key_values"), argument("attention_mask"))
        error = error or input_checks.check_text(module, argument, self.arguments.names)
        if error is None and given != self.layout:
            error = (
                f"torch_impl.hf: the batch was sharded with layout={given!r} but the model was "
                f"parallelized with layout={self.layout!r}; pass the same layout to hf.shard_batch and "
                "hf.parallelize"
            )
        if self.validate and not torch.compiler.is_compiling():  # no rank left waiting
            fields = input_checks.signature(argument, tokens, creates_cache)
            failed, differ = validation.compare_ranks(error is None, fields, tokens, self.group)
            if error is None and failed:
                error = f"torch_impl.hf: CP ranks {failed} rejected their inputs"
            elif error is None and differ:
                error = (
                    f"torch_impl.hf: CP ranks were given different inputs (1: passed, 0: not): "
                    f"{differ}; every rank must get its shard of the same global batch "
                    "(torch_impl.hf.shard_batch)"
                )
        return error

    def context(self, module, argument):
        """This forward's (Context, position_ids [B or 1, L] or mRoPE's [3, B, L], the other
        arguments it changes: media), from the inputs and what is gathered of them once: the
        padding mask, packed rows' positions, the token ids and types where media or the model's
        positions need them. ValueError for packed rows it cannot tell how to isolate."""
        tokens, cache, positions = (
            self.tokens(argument),
            argument("past_key_values"),
            argument("position_ids"),
        )
        (B, L), padding, creates_cache = (
            tokens.shape[:2],
            argument("attention_mask"),
            _creates_cache(module, argument),
        )
        gather = partial(gather_metadata, group=self.group, layout=self.layout)
        shard = ShardPlan.of(self.layout, _group.world_size(self.group), _group.rank(self.group), L)
        # bool [B, S]: the attention_mask, gathered here once per forward for every layer (a byte a
        # token), not by the mask functions, which some models call in an order that differs
        # between processes (over a set of layer types)
        padded = None if padding is None else gather(padding.bool())
        changes, images = {}, None
        if media.given(argument, self.arguments.names):  # images, videos: the model's merge, sharded
            rule = media.BLOCKWISE.get(getattr(module.config, "model_type", None))
            keys = TYPE_KEYS if rule is None else (rule.key, *TYPE_KEYS)  # (the types its masks read first)
            types = next((argument(k) for k in keys if argument(k) is not None), None)
            types = None if types is None else gather(types)  # [B, S]
            ids, rows = gather(argument("input_ids")), shard.rows(tokens.device)  # [B, S], [L]
            changes = media.inputs(module, argument, ids, types, padded, rows, self.group)
            positions = changes.pop("position_ids", positions)  # [3, B, L] where the model's mRoPE
            if rule is not None and argument(rule.key) is not None:  # the types its masks read
                images = media.images(module, types, shard)
                changes[rule.key] = None  # the model makes causal masks; the attention adds the images
        documents = everywhere = None
        packed = positions is not None and positions.ndim == 2 and padding is None and cache is None
        packed = packed and not creates_cache
        if packed and self.isolates is None:
            raise ValueError(
                f"torch_impl.hf: packed rows (position_ids without attention_mask) given to "
                f"{type(module).__name__}, a class torch_impl.hf.documents.ISOLATES does not list, so "
                "it cannot tell whether one process isolates the documents; give parallelize "
                "isolate_documents=, pass an attention_mask (the documents then attend across each "
                "other) or unpacked rows"
            )
        if packed and self.isolates:  # as one process would
            everywhere = gather(positions.expand(B, -1).contiguous())  # [B, S]
            documents = packed_ids(everywhere)  # [B, S]
            if images is not None and bool((documents[:, -1] != documents[:, 0]).any()):
                raise ValueError(
                    f"torch_impl.hf: packed rows (position_ids restarting, no attention_mask) with "
                    f"images whose tokens see each other ({module.config.model_type}): transformers' "
                    "sliding masks read the image ids at each document's own positions, which mixes "
                    "documents; pass unpacked rows"
                )
        if positions is None:
            ids = argument("input_ids") if self.positions.needs_ids else None
            rows = shard.rows(tokens.device)[None]  # [1, L]: this rank's global rows
            positions = self.positions(rows, None if ids is None else gather(ids), padded)  # [B or 1, L]
        chunks = None
        if self.chunk:
            S = L * _group.world_size(self.group)
            chunks = chunk_ids(self.chunk, padded, documents, everywhere, B, S, tokens.device)  # [B, S]
        documents, chunks = _documents(documents, chunks, shard.chunk_len)
        context = Context(self.owner, self.group, shard, documents, chunks, padded, self.kinds, images)
        return context, positions, changes

    def done(self, module, args, kwargs, output):
        """The forward hook (always called): the Context this forward's pre-hook set is unset."""
        if self.outer:
            RUNNING.context = self.outer.pop()
