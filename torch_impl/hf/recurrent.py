"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo hybrid; Kimi Delta Attention:
Kimi Linear; Mamba2: Nemotron-H, Granite 4.0 H, Falcon-H1, Bamba, Zamba2; Mamba: Jamba, Zamba,
Mamba, Falcon Mamba): the model's own forward, with its two sequence functions made
context-parallel (the diagonal forms, MambaScan and SelectiveScan, in torch_impl.hf.scans). MiniMax's
lightning attention, whose block loop is inline in its forward, is scans.LightningAttention;
RecurrentGemma's recurrent block, an nn.Conv1d and the RG-LRU's scan, scans.ConvModuleHalo and
scans.DiagonalScan.

Such a layer is a causal depthwise conv (kernel K) in front of a chunked linear recurrence whose
state S is [dk, dv] per head. Over a rank's chunk of the sequence the recurrence is an affine map of
the state it starts from, S_out = A S_in + B, and its outputs are o = o_0 + M S_in (o_0: the outputs
from a zero state). One run of the model's own kernel gives all four: values widened by dk zero
columns, initial state [0 | I] ([dk, dv + dk]); the value columns evolve independently, so the
first dv columns are o_0 and B, the last dk are M and A. `gather_state` then gives each chunk its
S_in from the earlier chunks' (A, B) (one all-gather of dk * (dk + dv) values per head and chunk,
whatever the length), and o = o_0 + M S_in. The conv takes its K - 1 preceding inputs by gather_halo.

Nothing global changes: the module's forward is its class's own function, decorators kept, over a
copy of its module's globals in which `causal_conv1d_fn` and the chunked kernel are the CP versions
below (the model's own functions, called over a halo / with the identity state; torch_impl.hf.rebind).
Those are transformers' kernel dispatchers: where flash-linear-attention, causal-conv1d or mamba_ssm
is installed they run that package's kernel, which the widened state and the float32 query are not
verified through, so `refusal` refuses the model naming the package. Checkpoints are unaffected
(the parameters are the module's own). Of the forward's context they read only its packed
documents (Packed): each document's state starts from zero and its conv reads nothing before it.
"""

import inspect
import types

import torch
from torch import nn

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import check_stateless
from torch_impl.hf.cca import CCAHalo, is_cca
from torch_impl.hf.documents import Packed, by_piece, conv_by_document, pieces
from torch_impl.hf.mlstm import MLSTMState, is_mlstm
from torch_impl.hf.rebind import global_loads, kernel_package, rebind
from torch_impl.hf.scans import (
    ConvModuleHalo,
    DiagonalScan,
    LightningAttention,
    MambaScan,
    SelectiveScan,
    over_chunks,
)
from torch_impl.layout import ShardPlan

CONV = "causal_conv1d_fn"  # (x [B, C, L], weight [C, K], bias, activation) -> [B, C, L]
# KERNELS (at the end, after the CP versions): chunked kernel -> (the recurrence, its CP version)
# MiniMax's lightning attention: per head its decay rate and the decays within a block
LIGHTNING = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
# fused kernels a forward tries first (mamba_ssm's conv + scan + norm + projection): under CP they
# would run over the shard alone, so the CP forward takes the model's unfused path
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")


def kernel_of(module: nn.Module) -> str | None:
    """The chunked kernel a linear-attention module's forward calls (a KERNELS key), where it also
    calls CONV with its own `conv1d`; else None."""
    names = global_loads(type(module).forward)
    kernel = next((name for name in KERNELS if name in names), None)
    conv = isinstance(getattr(module, "conv1d", None), nn.Conv1d) and CONV in names
    return kernel if conv else None


def is_short_conv(module: nn.Module) -> bool:
    """Whether `module` is a short convolution (LFM2's gated `Lfm2ShortConv`, Inkling's): a depthwise
    causal `conv` (or `conv1d`) whose forward calls CONV and no chunked kernel (ConvHalo alone
    makes it CP)."""
    conv = getattr(module, "conv", None) or getattr(module, "conv1d", None)
    names = global_loads(type(module).forward)
    return (
        isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and CONV in names
        and not any(name in names for name in KERNELS)
    )


def is_lightning(module: nn.Module) -> bool:
    """Whether `module` is MiniMax's lightning attention (LightningAttention below): its decay
    buffers, its projections and its norm, as transformers' MiniMaxLightningAttention has them."""
    parts = ("qkv_proj", "output_gate", "out_proj")
    return all(hasattr(module, name) for name in (*LIGHTNING, "norm", "act_fn", "block_size")) and all(
        isinstance(getattr(module, name), nn.Linear) for name in parts
    )


def is_griffin(module: nn.Module) -> bool:
    """Whether `module` is RecurrentGemma's recurrent block (transformers'
    RecurrentGemmaRecurrentBlock): a causal depthwise `conv_1d` (padding K - 1, its first L outputs
    kept) in front of an RG-LRU `rg_lru` whose `_rnn_scan` runs the diagonal recurrence."""
    conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
    return (
        isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and conv.padding[0] == conv.kernel_size[0] - 1
        and conv.stride[0] == conv.dilation[0] == 1
        and callable(getattr(lru, "_rnn_scan", None))
    )


def is_known(module: nn.Module) -> bool:
    """Whether `module` is a linear-attention module made CP here (or xLSTM's mLSTM, torch_impl.hf.mlstm;
    Zaya's CCA projection, torch_impl.hf.cca)."""
    known = kernel_of(module) is not None or is_lightning(module) or is_griffin(module)
    return known or is_mlstm(module) or is_cca(module)


def apply_recurrent(module: nn.Module, group, layout: str) -> str:
    """Run `module` (is_known(module) or is_short_conv(module)) context-parallel; returns the
    recurrence's name."""
    if is_lightning(module):
        module.forward = LightningAttention(module, group, layout)
        return "MiniMax lightning attention"
    if is_mlstm(module):
        module.forward = MLSTMState(module, group, layout)
        return "xLSTM's mLSTM"
    if is_cca(module):
        module.forward = CCAHalo(module, group, layout)
        return "Zaya's CCA projection"
    if is_griffin(module):
        halo = ConvModuleHalo(module.conv_1d, group, layout)
        module.rg_lru._rnn_scan = DiagonalScan(module.rg_lru._rnn_scan, group, layout, halo.packed)
        return "RecurrentGemma's RG-LRU"
    kernel = kernel_of(module)
    module.forward = types.MethodType(
        rebind(type(module).forward, _cp_functions(module, group, layout)), module
    )
    return "short convolution" if kernel is None else KERNELS[kernel][0]


def _replaced(module) -> list:
    """The global names a conv's or chunked recurrence's forward runs with replaced: its conv, its
    chunked kernel, the fused kernels it tries first."""
    kernel, loads = kernel_of(module), global_loads(type(module).forward)
    return [CONV, *([kernel] if kernel is not None else []), *(name for name in FUSED if name in loads)]


def _cp_functions(module, group, layout) -> dict:
    """The CP versions of the functions `_replaced(module)` names."""
    scope = inspect.unwrap(type(module).forward).__globals__
    conv = ConvHalo(scope[CONV], group, layout)
    functions = {CONV: conv}
    for name in _replaced(module)[1:]:
        cp = (
            Unfused(scope[name], conv.packed)
            if name in FUSED
            else KERNELS[name][1](scope[name], group, layout)
        )
        functions[name] = cp
    return functions


def refusal(module: nn.Module) -> str | None:
    """Why a conv's or chunked recurrence's forward (kernel_of or is_short_conv) cannot run over
    the CP functions, else None: a kernel package behind its conv or kernel, or a forward rebind
    cannot copy. None for the recurrences whose whole forward or scan is replaced."""
    if kernel_of(module) is None and not is_short_conv(module):
        return None
    scope = inspect.unwrap(type(module).forward).__globals__
    for name in (name for name in _replaced(module) if name not in FUSED):  # (under CP no fused one runs)
        package = kernel_package(scope.get(name))
        if package is not None:
            return (
                f"calls `{name}`, which transformers dispatches to {package}'s kernel, installed here: "
                "CP runs convs and chunked recurrences through transformers' PyTorch functions only "
                f"(the kernel called over a halo and from a widened [0 | I] state), so {package} must "
                "not be installed where this model trains context-parallel"
            )
    try:
        rebind(type(module).forward, dict.fromkeys(_replaced(module)))
    except ValueError as error:
        return str(error)
    return None


class Unfused:
    """A fused kernel (mamba_ssm's conv + scan + norm + projection) in a CP forward: None, the
    forward's cue for its own unfused path (the fused one would scan the shard alone); in an
    unsharded call the kernel itself."""

    def __init__(self, kernel, packed):
        self.kernel, self.packed = kernel, packed

    def __call__(self, *args, **kwargs):
        return self.kernel(*args, **kwargs) if self.packed.aside() else None


class ConvHalo:
    """The model's causal conv over each local chunk's K - 1 preceding inputs, then the chunk: the
    inputs travel as the sending rank computed them (the layer masks padding before its
    projections, as in one process), so no mask travels."""

    def __init__(self, conv, group, layout):
        self.conv, self.group, self.layout, self.packed = conv, group, layout, Packed(group)

    def __call__(self, x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        # x: [B, C, L]; weight: [C, K]
        if self.packed.aside():  # an unsharded call: the model's own conv
            return self.conv(x, weight, bias, activation=activation, seq_idx=seq_idx, **kwargs)
        check_stateless((), seq_idx)
        n, r, L = _group.world_size(self.group), _group.rank(self.group), x.shape[-1]
        reach = weight.shape[-1] - 1
        halo = gather_halo(x.transpose(1, 2), self.group, reach, layout=self.layout)  # [B, T, C]
        windows = ShardPlan.of(self.layout, n, r, L).windows(reach)
        first = self.packed.first_rows()
        if first is None:
            out = self.conv(halo.transpose(1, 2), weight, bias, activation=activation, **kwargs)  # [B, C, T]
            kept = [out[:, :, w.own] for w in windows]  # [B, C, L/k] each
        else:  # packed documents
            x = halo.transpose(1, 2)  # [B, C, T]
            kept = [conv_by_document(x[:, :, w.segment], weight, bias, w, first, activation) for w in windows]
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)  # [B, C, L]


class ChunkState:
    """The model's chunked kernel over each local chunk from the state the earlier chunks leave."""

    def __init__(self, kernel, group, layout):
        self.kernel, self.group, self.layout, self.packed = kernel, group, layout, Packed(group)

    def __call__(
        self, query, key, value, g, beta, *args, initial_state=None, output_final_state=False, **kwargs
    ):
        if self.packed.aside():  # an unsharded call: the model's own kernel
            return self.kernel(
                query, key, value, g, beta, *args, initial_state=initial_state,
                output_final_state=output_final_state, **kwargs
            )  # fmt: skip
        # query, key: [B, L, Hk, dk]; value: [B, L, H, dv]; g: [B, L, H] or [B, L, H, dk]; beta: [B, L, H]
        check_stateless(args, initial_state, output_final_state, kwargs.get("cu_seqlens"))
        (B, L, H, dv), dk = value.shape, key.shape[-1]
        # [B, H, dk, dv + dk]: zeros beside the identity, so the final state is [B | A]
        start = torch.eye(dk, device=value.device).expand(B, H, dk, dk)
        start = torch.cat([start.new_zeros(B, H, dk, dv), start], dim=-1)
        first = self.packed.first_rows()

        def chunk(w):
            rows = w.queries
            wide = torch.cat([value[:, rows], value.new_zeros(B, rows.stop - rows.start, H, dk)], dim=-1)

            def run(b, part, state, rows=rows, wide=wide):  # rows `part` of the chunk, batch rows b
                at = slice(rows.start + part.start, rows.start + part.stop)
                return self.kernel(  # the kernel's float32 outputs: query given as float32
                    query[b, at].float(),
                    key[b, at],
                    wide[b, part],  # [B, C, H, dv + dk]
                    g=g[b, at],
                    beta=beta[b, at],
                    initial_state=state,
                    output_final_state=True,
                    **kwargs,
                )

            split = pieces(first, w.start, w.end)
            if split is None:
                out, final = run(slice(None), slice(0, w.end - w.start), start)
            else:  # a piece after a document start runs from zero: no M, and A = 0 if it is the last
                carried, runs = split
                out, final = by_piece(
                    lambda b, lo, hi, head, carried=carried, run=run: run(
                        slice(b, b + 1),
                        slice(lo, hi),
                        start[b : b + 1] if head and carried[b, 0] else torch.zeros_like(start[b : b + 1]),
                    ),
                    runs,
                    dim=1,
                )
            # out [B, C, H, dv + dk]: o_0 | M; final [B, H, dk, dv + dk]: B | A
            return out, final[..., dv:], final[..., :dv]

        def correct(o, state):  # state [B, H, dk, dv]: the one this chunk starts from
            return o[..., :dv] + torch.einsum("bthk,bhkv->bthv", o[..., dv:], state)  # [B, C, H, dv]

        out = over_chunks(self.group, self.layout, L, chunk, correct, dim=1)  # [B, L, H, dv]
        return out.to(query.dtype), None


KERNELS = {  # chunked kernel -> (the recurrence it computes, its CP version)
    "torch_chunk_gated_delta_rule": ("Gated DeltaNet", ChunkState),
    "chunk_kimi_delta_attention": ("Kimi Delta Attention", ChunkState),
    "mamba2_chunk_scan": ("Mamba2 (SSD)", MambaScan),
    "mamba_selective_scan": ("Mamba (selective scan)", SelectiveScan),
}
