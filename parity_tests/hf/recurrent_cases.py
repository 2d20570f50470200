"""Cases for test_recurrent, run on every rank of a worker pool's group: a linear-attention kernel
(transformers' own) made CP by torch_impl.hf.recurrent.ChunkState, on this rank's shard."""

from contextlib import contextmanager

import torch

from torch_impl.hf._common import RUNNING, Context
from torch_impl.hf.recurrent import ChunkState
from torch_impl.layout import Documents, ShardPlan

NAMES = ("query", "key", "value", "g", "beta")


def kernel(name):
    """transformers' chunked kernel: "gdn" (Gated DeltaNet, Qwen3.5's) or "kda" (Kimi Linear's)."""
    if name == "gdn":
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        return torch_chunk_gated_delta_rule
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention


@contextmanager
def packed(group, layout, L, documents):
    """The forward's context as torch_impl.hf's pre-hook makes it for packed rows, whose document
    ids by global row are `documents` [B, S] (None: no context, unpacked rows)."""
    outer = RUNNING.context
    if documents is not None:
        shard = ShardPlan.of(layout, group.size(), group.rank(), L)
        RUNNING.context = Context(0, group, shard, Documents(documents, None), None, None, None)
    try:
        yield
    finally:
        RUNNING.context = outer


def each_document(run, leaves, documents, dim=1):
    """`run(slices)` on each document of each row alone ({key: [1, ..., T, ...]} along `dim`), the
    outputs put back in the rows' places: what packed rows must give."""
    rows = []
    for b, ids in enumerate(documents.tolist()):
        starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
        pieces = []
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            at = (b, slice(None)) if dim == 2 else (b,)
            pieces.append(run({key: x[at][None].narrow(dim, lo, hi - lo) for key, x in leaves.items()}))
        rows.append(torch.cat(pieces, dim=dim))
    return torch.cat(rows)


def one_process(name, inputs, cotangent, l2norm, documents=None):
    """The kernel over the whole sequence (documents [B, S]: each document alone): its output
    [B, S, H, dv] and each input's gradient."""
    leaves = {key: inputs[key].clone().requires_grad_(True) for key in NAMES}
    run = lambda x: kernel(name)(*x.values(), use_qk_l2norm_in_kernel=l2norm)[0]  # noqa: E731
    out = run(leaves) if documents is None else each_document(run, leaves, documents)
    out.backward(cotangent)
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def chunk_state(group, name, inputs, cotangent, layout, l2norm, documents=None):
    """The kernel made CP on this rank's rows of the global inputs ([B, S, ...] each), in packed
    rows' context where documents are given: its output [B, L, H, dv] and the gradients of this
    rank's inputs."""
    n, r, L = group.size(), group.rank(), inputs["query"].shape[1] // group.size()
    rows = ShardPlan.of(layout, n, r, L).rows()  # [L]
    leaves = {key: inputs[key][:, rows].clone().requires_grad_(True) for key in NAMES}
    with packed(group, layout, L, documents):
        out, final = ChunkState(kernel(name), group, layout)(*leaves.values(), use_qk_l2norm_in_kernel=l2norm)
    assert final is None
    out.backward(cotangent[:, rows])
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def refusals(group, family="qwen3_5"):
    """A parallelized Qwen3.5 (or a zoo family: Zaya) called to make a cache (generation): each
    rank's ValueError message."""
    from parity_tests.hf import hf_models, zoo
    from torch_impl import hf

    if family == "qwen3_5":
        model, batch = hf_models.build("qwen3_5"), hf_models.make_batch()
    else:
        model = zoo.build(family)
        batch = zoo.padded_batch(model.config)
    model = hf.parallelize(model, group, verbose=False)
    local = hf.shard_batch(batch, group) | {"use_cache": True}
    try:
        model(**local)
    except ValueError as e:
        return str(e)
    return None


MAMBA_NAMES = ("hidden_states", "dt", "B", "C")  # by token; A [H] and D [H] are the layer's own


def mamba_scan():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return mamba2_chunk_scan


def _mamba_args(leaves, A, D):
    return (leaves["hidden_states"], leaves["dt"], A, leaves["B"], leaves["C"], MAMBA_CHUNK), {"D": D}


MAMBA_CHUNK = 16  # the scan's chunk: L = 48 or 80 tokens a rank straddle one process's chunks


def mamba_one_process(inputs, cotangent, documents=None):
    """Mamba2's scan over the whole sequence (documents [B, S]: each document alone): its output
    [B, S, H, P], the gradients of the token inputs and of A and D."""
    leaves = {key: inputs[key].clone().requires_grad_(True) for key in (*MAMBA_NAMES, "A", "D")}

    def run(tokens):
        args, kwargs = _mamba_args(tokens, leaves["A"], leaves["D"])
        return mamba_scan()(*args, **kwargs)

    tokens = {key: leaves[key] for key in MAMBA_NAMES}
    out = run(tokens) if documents is None else each_document(run, tokens, documents)
    out.backward(cotangent)
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def mamba_state(group, inputs, cotangent, layout, documents=None):
    """The scan made CP (torch_impl.hf.scans.MambaScan) on this rank's rows (in packed rows'
    context where documents are given): its output [B, L, H, P] and the gradients of this rank's
    token inputs and its partial ones of A and D."""
    from torch_impl.hf.scans import MambaScan

    n, r, L = group.size(), group.rank(), inputs["dt"].shape[1] // group.size()
    rows = ShardPlan.of(layout, n, r, L).rows()  # [L]
    leaves = {key: inputs[key][:, rows].clone().requires_grad_(True) for key in MAMBA_NAMES}
    leaves |= {key: inputs[key].clone().requires_grad_(True) for key in ("A", "D")}
    args, kwargs = _mamba_args(leaves, leaves["A"], leaves["D"])
    with packed(group, layout, L, documents):
        out = MambaScan(mamba_scan(), group, layout)(*args, **kwargs)
    out.backward(cotangent[:, rows])
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


SELECTIVE_NAMES = ("u", "dt", "B", "C", "z")  # by token, channels first: [B, D, L] or [B, N, L]
SELECTIVE_LAYER = ("A", "D", "delta_bias")  # the layer's own: [D, N], [D], [D]


def _selective(scan, leaves, softplus):
    """Mamba's selective scan (transformers' torch one, or it made CP) on `leaves`."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    args = (leaves[key] for key in ("u", "dt", "A", "B", "C"))
    kwargs = {key: leaves.get(key) for key in ("D", "z", "delta_bias")}
    return (scan or mamba_selective_scan)(*args, **kwargs, delta_softplus=softplus)


def selective_one_process(inputs, cotangent, softplus):
    """Mamba's selective scan over the whole sequence: its output [B, D, S] and every gradient."""
    leaves = {key: None if x is None else x.clone().requires_grad_(True) for key, x in inputs.items()}
    out = _selective(None, leaves, softplus)
    out.backward(cotangent)
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items() if leaf is not None}


def selective_state(group, inputs, cotangent, layout, softplus):
    """The scan made CP (torch_impl.hf.scans.SelectiveScan) on this rank's tokens: its output
    [B, D, L] and the gradients of this rank's token inputs and its partial ones of the layer's."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    from torch_impl.hf.scans import SelectiveScan

    n, r = group.size(), group.rank()
    rows = ShardPlan.of(layout, n, r, inputs["u"].shape[-1] // n).rows()  # [L]
    leaves = {key: inputs[key] for key in SELECTIVE_NAMES if inputs[key] is not None}  # (z: a gate or None)
    leaves = {key: x[..., rows].clone().requires_grad_(True) for key, x in leaves.items()}
    leaves |= {key: inputs[key].clone().requires_grad_(True) for key in SELECTIVE_LAYER}
    out = _selective(SelectiveScan(mamba_selective_scan, group, layout), leaves, softplus)
    out.backward(cotangent[..., rows])
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}
