"""What each gloo rank runs for the model sweep: one family of the zoo (parity_tests.hf.zoo), made CP by
torch_impl.hf, against the same model in one process, on each of the sweep's batches.

Every rank builds the model from the same seed and runs the single-process reference itself (the
whole batch), then the CP model on its shard. Both run with the model's float32 steps kept in
float64 (`Float64Steps`: transformers rounds float64 models through float32 in its norms, routers
and losses; a family that is exact with those casts kept in float64 is exact), so that the two
differ only by float64 sums taken in another order, and the bounds are float64's:

- logits: 2 layers (S + hidden) u64 of their largest entry (each layer sums over up to S keys and
  over its width, the projections' and the scores' dot products, in another order: the fused
  attention blocks them otherwise; hf_reference's bound without its float32 steps);
- the summed loss: 2 (B S + n) u64 of itself plus twice the logits' bound;
- each parameter's gradient, summed over the ranks: 2 (B S H + layers S) u64 of the model's largest
  gradient entry (a weight gradient sums B S tokens' contributions over H heads; a gradient that is
  zero in exact arithmetic, such as a key bias's under softmax, is rounding noise around zero, so the
  scale is the model's, not the parameter's own).

A wrong result is far outside them: without `parallelize` every family that mixes tokens is off by
1e-3 or more (parity_tests/hf/test_models.py checks that the sweep says so).
"""

from contextlib import ExitStack, contextmanager, nullcontext
import copy
import inspect
from pathlib import Path
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from parity_tests.harness import bounds
from parity_tests.hf import zoo
from torch_impl import hf
from torch_impl.hf.batch import TYPE_KEYS
from torch_impl.hf.compressed import CompressedEntries
from torch_impl.hf.inkling import RelativeTable
from torch_impl.layout import ShardPlan


class Float64Steps(TorchFunctionMode):
    """A float64 tensor that the model casts to float32 stays float64 (`x.float()`, `x.to(torch.float32)`,
    `softmax(x, dtype=torch.float32)`, ...), and an integer one cast to float32, or a tensor made
    as float32, is float64 (GLM-4V's image sizes scaling its position table, Qwen3-Omni's table of
    positions): the model's float32 steps run in float64, torch_impl's too (a float32 tensor made
    there is not checked by these float64 comparisons: the autocast tests run float32). A function
    mode, above autograd, so that autograd records the dtypes the tensors have."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dtype == torch.float64 or not (x.is_floating_point() or x.is_complex()):
            if func is torch.Tensor.float:
                return x.double()
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def float64_recompute(kwargs):
    """Activation checkpointing kwargs whose recomputation runs under Float64Steps as the forward
    does (a function mode is not active in backward)."""
    inner = kwargs.get("context_fn", lambda: (nullcontext(), nullcontext()))
    return kwargs | {"context_fn": lambda: tuple(_entered(Float64Steps(), c) for c in inner())}


@contextmanager
def _entered(*managers):
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _run(model, batch, alone=False):
    """(logits, loss, gradients) of the model on the batch; alone: each packed document alone."""
    with Float64Steps():
        if alone:
            logits, loss = each_document_alone(model, batch)
        else:
            out = model(**batch)
            logits, loss = out.logits, out.loss
        loss.backward()
    grads = {key: p.grad for key, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def document_spans(positions):
    """Per row of position_ids [B, S], the [lo, hi) of each packed document: a document begins
    where the positions do not go on by one (transformers' find_packed_sequence_indices)."""
    spans = []
    for row in positions.tolist():
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1] + 1] + [len(row)]
        spans.append(list(zip(starts[:-1], starts[1:], strict=True)))
    return spans


def each_document_alone(model, batch):
    """The model in one process on each packed document of `batch` alone (a row of its own, its
    own positions): the logits [B, S, V] in the batch's places, and the model's loss over them
    (labels shifted over the whole row, as the packed forward takes it). What CP gives a model
    with recurrent layers on packed rows: each document's state starts from zero."""
    rows = []
    for b, spans in enumerate(document_spans(batch["position_ids"])):
        one = [
            model(
                input_ids=batch["input_ids"][b : b + 1, lo:hi],
                position_ids=batch["position_ids"][b : b + 1, lo:hi],
            )
            for lo, hi in spans
        ]
        rows.append(torch.cat([out.logits for out in one], dim=1))
    logits = torch.cat(rows)
    vocab = model.config.get_text_config().vocab_size
    return logits, model.loss_function(logits=logits, labels=batch["labels"], vocab_size=vocab)


def isolates_recurrences(model):
    """Whether `model` has linear-attention layers or short convs that CP runs per packed document
    (torch_impl.hf.recurrent's, in a model that isolates packed documents)."""
    from torch_impl.hf.documents import isolates_documents
    from torch_impl.hf.recurrent import is_known, is_short_conv

    known = any(is_known(m) or is_short_conv(m) for m in model.modules())
    return bool(isolates_documents(model.modules())) and known


def _error(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def compare(group, model_type, case, cp=True, checkpointing=False, task="causal_lm"):
    """One family on one of the sweep's batches (zoo.CASES) on this rank: a verdict dict.

    {"verdict": "exact" | "wrong" | "refused" | "crash" | "skipped", "why": ..., "ratios": the
    worst difference / bound of logits, loss and gradients}. "skipped": the zoo could not build the
    model or one process cannot run the batch (the reason). cp False: the same without
    `parallelize` (each rank runs the model on its own shard alone), which must come out wrong.
    checkpointing: both models in train mode with activation checkpointing (the CP one with
    hf.checkpoint_kwargs(), or with transformers' default where "plain"; one process with
    transformers' default). task: zoo.TASKS' (the class
    built; "image_text" takes its cases from zoo.IMAGE_TEXT_CASES).
    """
    default = torch.get_default_dtype()
    if model_type in zoo.DEFAULT_FLOAT64:
        torch.set_default_dtype(torch.float64)
    try:
        return _compare(group, model_type, case, cp, checkpointing, task)
    finally:
        torch.set_default_dtype(default)


def compare_in_query_blocks(group, model_type, case, block):
    """`compare` with the layers that run their queries in blocks (DeepSeek V4's compressed ones,
    Inkling's relative-logit ones) running `block` queries at a time (their default, 256, is more
    than the sweep's shards hold)."""
    defaults = CompressedEntries.query_block, RelativeTable.query_block
    CompressedEntries.query_block = RelativeTable.query_block = block
    try:
        return compare(group, model_type, case, True, True)
    finally:
        CompressedEntries.query_block, RelativeTable.query_block = defaults


def left_padding_refusal(group, model_type):
    """The message with which a family in zoo.RIGHT_PADDED refuses left-padded rows (None: ran)."""
    model = zoo.build(model_type)
    hf.parallelize(model, group, verbose=False)
    try:
        model(**hf.shard_batch(zoo.padded_batch(model.config, left=True), group))
    except ValueError as e:
        return str(e)
    return None


NO_TOKEN_TYPES = "its forward takes no token types"


def _compare(group, model_type, case, cp, checkpointing, task):
    layout, make_batch = (zoo.IMAGE_TEXT_CASES if task == "image_text" else zoo.CASES)[case]
    if model_type in zoo.SKIPPED:
        return {"verdict": "skipped", "why": zoo.SKIPPED[model_type]}
    try:
        model = zoo.build(model_type, task=task)
        batch = make_batch(model.config)
        taken = inspect.signature(model.forward).parameters
        batch = {key: value for key, value in batch.items() if key not in TYPE_KEYS or key in taken}
        if make_batch is zoo.typed_batch and not set(TYPE_KEYS) & set(batch):
            return {"verdict": "skipped", "why": NO_TOKEN_TYPES}
        one_process = copy.deepcopy(model)
    except Exception as e:  # the zoo's limit, not the adapter's
        return {"verdict": "skipped", "why": _error(e)}
    try:
        if cp:
            hf.parallelize(model, group, layout=layout, verbose=False)
    except ValueError as e:
        return {"verdict": "refused", "why": str(e).splitlines()[0]}
    if checkpointing:  # "plain": the CP model too with transformers' default (no hf.checkpoint_kwargs())
        ours = {"use_reentrant": False} if checkpointing == "plain" else hf.checkpoint_kwargs()
        for each, kwargs in ((one_process, {"use_reentrant": False}), (model, ours)):
            each.train()
            each.activation_checkpointing_enable(activation_checkpointing_kwargs=float64_recompute(kwargs))
    try:  # packed rows in a model with recurrences: CP runs each document's state from zero
        alone = (
            "position_ids" in batch and "attention_mask" not in batch and isolates_recurrences(one_process)
        )
        reference = _run(one_process, batch, alone)
    except Exception as e:  # one process cannot run the batch
        return {"verdict": "skipped", "why": _error(e)}
    if not torch.isfinite(reference[0]).all():
        return {"verdict": "skipped", "why": "one process gives non-finite logits on this batch"}
    try:
        local = hf.shard_batch(batch, group, layout=layout)
        logits, loss, grads = _run(model, local)
    except ValueError as e:
        if _raised_by_the_adapter(e):
            return {"verdict": "refused", "why": str(e).splitlines()[0]}
        return {"verdict": "crash", "why": traceback.format_exc()[-2000:]}
    except Exception:
        return {"verdict": "crash", "why": traceback.format_exc()[-2000:]}
    ratios, why = _ratios(model, batch, reference, (logits, loss, grads), group, layout)
    return {"verdict": "exact" if max(ratios.values()) <= 1 else "wrong", "why": why, "ratios": ratios}


def _raised_by_the_adapter(error):
    """Whether a ValueError is one of torch_impl's refusals (raised in its own code)."""
    return "torch_impl" in Path(traceback.extract_tb(error.__traceback__)[-1].filename).parts


def _ratios(model, batch, reference, local, group, layout):
    """Each comparison's difference over its bound (the module docstring's), and what came out worst."""
    ref_logits, ref_loss, ref_grads = reference
    logits, loss, grads = local
    (B, S), n = batch["input_ids"].shape, dist.get_world_size(group)
    layers, heads = zoo.depth(model.config), zoo.heads(model.config)
    u = bounds.u("float64")
    rows = ShardPlan.of(layout, n, dist.get_rank(group), S // n).rows()  # [L]: this rank's global rows
    valid = batch.get("attention_mask", torch.ones(B, S))[:, rows].bool()  # [B, L]
    logits_bound = 2 * layers * (S + zoo.width(model.config)) * u * ref_logits.abs().max()
    differences = {"logits": (logits - ref_logits[:, rows]).abs()[valid].max() / logits_bound}
    total = loss.clone()
    dist.all_reduce(total, group=group)
    loss_bound = 2 * (B * S + n) * u * ref_loss.abs() + 2 * logits_bound
    differences["loss"] = (total - ref_loss).abs() / loss_bound
    scale = max(g.abs().max() for g in ref_grads.values() if g is not None)
    grads_bound = 2 * (B * S * heads + layers * S) * u * scale
    worst, worst_key, missing = 0.0, None, []
    for key, g in ref_grads.items():  # the same order on every rank: the all_reduces pair up
        if (g is None) != (grads[key] is None):
            missing.append(key)
            continue
        if g is None:
            continue
        summed = grads[key].clone()
        dist.all_reduce(summed, group=group)
        ratio = float((summed - g).abs().max() / grads_bound)
        if ratio > worst:
            worst, worst_key = ratio, key
    differences["grads"] = worst if not missing else float("inf")
    ratios = {k: float(v) for k, v in differences.items()}
    what = max(ratios, key=ratios.get)
    why = (
        f"gradient of {missing} in one of the runs only"
        if missing
        else f"{what} at {ratios[what]:.2g}x the bound"
    )
    if what == "grads" and not missing:
        why += f" ({worst_key})"
    return ratios, why


def compiled_whole_model(group, model_type, case):
    """The family made CP, then the whole model compiled (aot_eager, fullgraph=True: the pre-hook,
    the masks carrying the forward's context and every layer in one graph): the largest difference
    of its logits from the eager model's on the case's batch."""
    import torch._dynamo

    torch._dynamo.reset()
    layout, make_batch = zoo.CASES[case]
    model = zoo.build(model_type)
    hf.parallelize(model, group, layout=layout, verbose=False)
    local = hf.shard_batch(make_batch(model.config), group, layout=layout)
    eager = model(**local).logits
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**local).logits
    return float((compiled - eager).abs().max())


def mask_outside_the_forward(group, model_type):
    """A CP model's causal mask made outside its forward (its pre-hook never ran): the ValueError."""
    from transformers.masking_utils import create_causal_mask

    model = zoo.build(model_type)
    hf.parallelize(model, group, verbose=False)
    embeds = torch.zeros(1, 4, model.config.hidden_size, dtype=torch.float64)
    try:
        create_causal_mask(
            config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None
        )
    except ValueError as e:
        return str(e)
    return None
