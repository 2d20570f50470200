"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo hybrid; Kimi Delta Attention:
Kimi Linear; Mamba2: Nemotron-H, Granite 4.0 H, Falcon-H1, Bamba, Zamba2; Mamba: Jamba, Zamba,
Mamba, Falcon Mamba): the model's own forward, with its two sequence functions made
context-parallel (MambaScan and SelectiveScan below for the diagonal forms). MiniMax's lightning
attention, whose block loop is inline in its forward, is LightningAttention; RecurrentGemma's
recurrent block, an nn.Conv1d and the RG-LRU's scan, ConvModuleHalo and DiagonalScan (at the end).

Such a layer is a causal depthwise conv (kernel K) in front of a chunked linear recurrence whose
state S is [dk, dv] per head. Over a rank's chunk of the sequence the recurrence is an affine map of
the state it starts from, S_out = A S_in + B, and its outputs are o = o_0 + M S_in (o_0: the outputs
from a zero state). One run of the model's own kernel gives all four: values widened by dk zero
columns, initial state [0 | I] ([dk, dv + dk]); the value columns evolve independently, so the
first dv columns are o_0 and B, the last dk are M and A. `gather_state` then gives each chunk its
S_in from the earlier chunks' (A, B) (one all-gather of dk * (dk + dv) values per head and chunk,
whatever the length), and o = o_0 + M S_in. The conv takes its K - 1 preceding inputs by gather_halo.

Nothing global changes: the module's forward is its class's own function with a copy of its
module's globals in which `causal_conv1d_fn` and the chunked kernel are the CP versions below (the
model's own functions, called over a halo / with the identity state). Checkpoints are unaffected
(the parameters are the module's own). Of the forward's context they read only its packed
documents (Packed): each document's state starts from zero and its conv reads nothing before it.
"""

import dis
import inspect
import types

import torch
from torch import nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import check_stateless
from torch_impl.hf.cca import CCAHalo, is_cca
from torch_impl.hf.documents import Packed
from torch_impl.hf.mlstm import MLSTMState, is_mlstm
from torch_impl.layout import ShardPlan
from torch_impl.state import gather_state

CONV = "causal_conv1d_fn"  # (x [B, C, L], weight [C, K], bias, activation) -> [B, C, L]
# KERNELS (at the end, after the CP versions): chunked kernel -> (the recurrence, its CP version)
# MiniMax's lightning attention: per head its decay rate and the decays within a block
LIGHTNING = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
# fused kernels a forward tries first (mamba_ssm's conv + scan + norm + projection): under CP they
# would run over the shard alone, so the CP forward takes the model's unfused path
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")


def _global_loads(module: nn.Module) -> set:
    """The global names a module's forward loads (its bytecode's LOAD_GLOBAL): what apply_recurrent
    can replace (a `self.causal_conv1d_fn` attribute is not)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    loads = dis.get_instructions(code) if code is not None else ()
    return {i.argval for i in loads if i.opname == "LOAD_GLOBAL"}


def kernel_of(module: nn.Module) -> str | None:
    """The chunked kernel a linear-attention module's forward calls (a KERNELS key), where it also
    calls CONV with its own `conv1d`; else None."""
    names = _global_loads(module)
    kernel = next((name for name in KERNELS if name in names), None)
    conv = isinstance(getattr(module, "conv1d", None), nn.Conv1d) and CONV in names
    return kernel if conv else None


def is_short_conv(module: nn.Module) -> bool:
    """Whether `module` is a short convolution (LFM2's gated `Lfm2ShortConv`, Inkling's): a depthwise
    causal `conv` (or `conv1d`) whose forward calls CONV and no chunked kernel (ConvHalo alone
    makes it CP)."""
    conv, names = getattr(module, "conv", None) or getattr(module, "conv1d", None), _global_loads(module)
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
    forward = inspect.unwrap(type(module).forward)
    # the module's globals but its __name__: torch.compile reads a named scope's globals from the
    # module of that name (where the CP functions are not), an unnamed one from this dict
    scope = {name: value for name, value in forward.__globals__.items() if name != "__name__"}
    scope[CONV] = conv = ConvHalo(scope[CONV], group, layout)
    if kernel is not None:
        scope[kernel] = KERNELS[kernel][1](scope[kernel], group, layout)
    scope.update({name: Unfused(scope[name], conv.packed) for name in FUSED if scope.get(name) is not None})
    own = types.FunctionType(
        forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__
    )
    own.__kwdefaults__ = forward.__kwdefaults__
    module.forward = types.MethodType(own, module)
    return "short convolution" if kernel is None else KERNELS[kernel][0]


class Unfused:
    """A fused kernel (mamba_ssm's conv + scan + norm + projection) in a CP forward: None, the
    forward's cue for its own unfused path (the fused one would scan the shard alone); in an
    unsharded call the kernel itself."""

    def __init__(self, kernel, packed):
        self.kernel, self.packed = kernel, packed

    def __call__(self, *args, **kwargs):
        return self.kernel(*args, **kwargs) if self.packed.aside() else None


def pieces(first, start, stop):
    """For the global rows [start, stop) of each batch row: bool [B, T] whether a token's document
    began before `start` (the state coming in reaches it), and per row the pieces [lo, hi) (local
    to the rows) that run from zero, cut where a document begins; None where no document begins
    in them (one piece per row, every token reached). `first`: Packed.first_rows(), or None."""
    if first is None:
        return None
    first = first[:, start:stop]  # [B, T]
    carried = first < max(start, 1)  # the sequence's first chunk: its first document takes the zero state
    begins = first == torch.arange(start, stop, device=first.device)  # [B, T]
    begins[:, 0] = True
    if carried.all():
        return None
    cuts = [[t for t, b in enumerate(row) if b] + [stop - start] for row in begins.tolist()]
    return carried, [list(zip(row[:-1], row[1:], strict=True)) for row in cuts]


def by_piece(run, runs, dim):
    """Each row's pieces run alone from zero (`run(b, lo, hi, first)` -> (outputs [1, ...],
    final state [1, ...]); `first`: the row's first piece), the outputs concatenated along `dim`
    and the last piece's final state, stacked over the rows."""
    outs, finals = [], []
    for b, row in enumerate(runs):
        parts = [run(b, lo, hi, i == 0) for i, (lo, hi) in enumerate(row)]
        outs.append(torch.cat([out for out, _ in parts], dim=dim))
        finals.append(parts[-1][1])
    return torch.cat(outs), torch.cat(finals)


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


def conv_by_document(x, weight, bias, w, first, activation=None):
    """A causal depthwise conv (weight [C, K], bias [C] or None, then `activation`, as transformers'
    `causal_conv1d_fn`) over one local chunk's segment x [B, C, T] (the window w's halo, then the
    chunk) whose outputs read nothing before their document's start: each tap masked where it
    would read an earlier document (no host read, no branch: it compiles as one graph). The
    chunk's outputs, [B, C, w.end - w.start]."""
    K, T = weight.shape[-1], w.end - w.first_key
    x = x[..., -T:]  # [B, C, T]: global rows [first_key, end)
    dtype = torch.promote_types(weight.dtype, torch.float32)  # summed as F.conv1d accumulates
    taps = F.pad(x.to(dtype), (K - 1, 0)).unfold(-1, K, 1)  # [B, C, T, K]: tap j reads t - K + 1 + j
    rows = torch.arange(w.first_key, w.end, device=x.device)  # [T]
    read = rows[:, None] - (K - 1) + torch.arange(K, device=x.device)  # [T, K]: the global row each tap reads
    keep = read[None] >= first[:, w.first_key : w.end, None]  # [B, T, K]: within the output's document
    out = (taps * keep[:, None] * weight.to(dtype)[:, None, :]).sum(dim=-1)  # [B, C, T]
    out = (out if bias is None else out + bias.to(dtype)[:, None]).to(weight.dtype)
    out = ACT2FN[activation](out) if activation is not None else out
    return out[..., -(w.end - w.start) :].to(x.dtype)


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
        n, r, L = _group.world_size(self.group), _group.rank(self.group), query.shape[1]
        (B, _, H, dv), dk = value.shape, key.shape[-1]
        # [B, H, dk, dv + dk]: zeros beside the identity, so the final state is [B | A]
        start = torch.eye(dk, device=value.device).expand(B, H, dk, dk)
        start = torch.cat([start.new_zeros(B, H, dk, dv), start], dim=-1)
        outs, maps, first = [], [], self.packed.first_rows()
        for w in ShardPlan.of(self.layout, n, r, L).windows(0):
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
            outs.append(out)  # [B, C, H, dv + dk]: o_0 | M
            maps.append(final)  # [B, H, dk, dv + dk]: B | A
        maps = torch.stack(maps, dim=1)  # [B, k, H, dk, dv + dk]
        # [B, k, H, dk, dv]: the state each local chunk starts from
        states = gather_state(maps[..., dv:], maps[..., :dv], self.group, layout=self.layout)
        out = [
            o[..., :dv] + torch.einsum("bthk,bhkv->bthv", o[..., dv:], states[:, i])  # [B, C, H, dv]
            for i, o in enumerate(outs)
        ]
        out = out[0] if len(out) == 1 else torch.cat(out, dim=1)  # [B, L, H, dv]
        return out.to(query.dtype), None


class MambaScan:
    """The model's Mamba2 chunked scan (SSD) over each local chunk, corrected by the state the
    earlier chunks leave. Per head the state S is [P, N] (head_dim, state) and a chunk's transition
    a scalar decay: S_out = a S_in + B with a = exp(sum of A dt), and the outputs are
    y_t = y0_t + exp(sum of A dt up to t) S_in C_t (y0: from a zero state, D's skip included). So
    one run of the scan from zero gives y0 and B (its final state); a and the decays to each token
    come from dt as the scan discretizes it (dt + dt_bias, softplus, clamped to dt_limit); no
    second pass over the shard. gather_state folds (a, B) with S as [1, P * N]."""

    def __init__(self, scan, group, layout):
        self.scan, self.group, self.layout, self.packed = scan, group, layout, Packed(group)

    def __call__(
        self,
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        *args,
        initial_states=None,
        dt_bias=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        **kwargs,
    ):
        # hidden_states: [B, L, H, P]; dt: [B, L, H]; A: [H]; B, C: [B, L, G, N]
        if self.packed.aside():  # an unsharded call: the model's own scan
            return self.scan(
                hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states,
                dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, **kwargs
            )  # fmt: skip
        given = [kwargs.pop(k, None) for k in ("return_final_states", "cu_seqlens", "seq_idx")]
        check_stateless(args, initial_states, *given)
        n, r, L = _group.world_size(self.group), _group.rank(self.group), hidden_states.shape[1]
        (batch, _, H, P), N = hidden_states.shape, B.shape[-1]
        discrete = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        outs, decays, maps, first = [], [], [], self.packed.first_rows()
        for w in ShardPlan.of(self.layout, n, r, L).windows(0):
            rows = w.queries

            def run(b, lo, hi, _, rows=rows):  # batch rows b, rows [lo, hi) of the chunk, from zero
                at = slice(rows.start + lo, rows.start + hi)
                return self.scan(  # [B, C, H, P], [B, H, P, N]
                    hidden_states[b, at], dt[b, at], A, B[b, at], C[b, at], chunk_size,
                    return_final_states=True, **discrete, **kwargs,
                )  # fmt: skip

            split = pieces(first, w.start, w.end)
            if split is None:
                y0, final = run(slice(None), 0, w.end - w.start, True)
            else:
                y0, final = by_piece(lambda b, *part: run(slice(b, b + 1), *part), split[1], dim=1)
            step = dt[:, rows] if dt_bias is None else dt[:, rows] + dt_bias.to(dt.dtype)
            step = torch.nn.functional.softplus(step) if dt_softplus else step
            step = torch.clamp(step, min=dt_limit[0], max=dt_limit[1])
            # [B, C, H]: the decay to each token, inclusive (0 after a document start)
            reached = (A.float() * step.float()).cumsum(dim=1).exp()
            reached = reached if split is None else reached * split[0][..., None]
            outs.append((y0, reached, C[:, rows]))
            decays.append(reached[:, -1][..., None, None])  # [B, H, 1, 1]: a
            maps.append(final.reshape(batch, H, 1, P * N))  # [B, H, 1, P * N]: B
        # [B, k, H, P, N]: the state each local chunk starts from
        states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), self.group, layout=self.layout)
        states = states.reshape(batch, len(outs), H, P, N)
        out = []
        for i, (y0, reached, c) in enumerate(outs):
            c = c.float().repeat_interleave(H // c.shape[2], dim=2) * reached[..., None]  # [B, C, H, N]
            out.append(y0 + torch.einsum("bthn,bhpn->bthp", c, states[:, i]))  # [B, C, H, P]
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)  # [B, L, H, P]


class SelectiveScan:
    """The model's Mamba selective scan over each local chunk, corrected by the state the earlier
    chunks leave. Per channel d the state is [N] and its transition diagonal, exp(A[d] dt_t), so over
    a chunk S_out = a * S_in + B with a = exp(A[d] * sum of dt), and the outputs before the gate are
    y_t = y0_t + C_t . (exp(A[d] * sum of dt up to t) * S_in) (y0: from a zero state, D's skip
    included). One run of the scan from zero, ungated, gives y0 and B (its final state); dt is
    discretized as the scan does it (dt + delta_bias, softplus); then the gate. gather_state folds
    (a, B) with each of the D * N state entries its own 1 x 1 map."""

    def __init__(self, scan, group, layout):
        self.scan, self.group, self.layout, self.packed = scan, group, layout, Packed(group)

    def __call__(
        self, u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
        return_last_state=False, **kwargs,
    ):  # fmt: skip
        # u, dt, z: [batch, D, L]; A: [D, N]; B, C: [batch, N, L]; D, delta_bias: [D]
        if self.packed.aside():  # an unsharded call: the model's own scan
            return self.scan(
                u, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, **kwargs
            )  # fmt: skip
        check_stateless((), return_last_state, kwargs.get("cu_seqlens"), kwargs.get("seq_idx"))
        n, r, L = _group.world_size(self.group), _group.rank(self.group), u.shape[-1]
        (batch, channels, _), N = u.shape, A.shape[-1]
        outs, decays, maps, first = [], [], [], self.packed.first_rows()
        for w in ShardPlan.of(self.layout, n, r, L).windows(0):
            rows = w.queries

            def run(b, lo, hi, _, rows=rows):  # batch rows b, rows [lo, hi) of the chunk, from zero
                at = slice(rows.start + lo, rows.start + hi)
                return self.scan(  # [batch, D, C], [batch, D, N]
                    u[b, :, at], dt[b, :, at], A, B[b, :, at], C[b, :, at], D=D, z=None,
                    delta_bias=delta_bias, delta_softplus=delta_softplus, return_last_state=True, **kwargs,
                )  # fmt: skip

            split = pieces(first, w.start, w.end)
            if split is None:
                y0, final = run(slice(None), 0, w.end - w.start, True)
            else:
                y0, final = by_piece(lambda b, *part: run(slice(b, b + 1), *part), split[1], dim=2)
            step = dt[..., rows] if delta_bias is None else dt[..., rows] + delta_bias.to(dt.dtype)[..., None]
            step = torch.nn.functional.softplus(step) if delta_softplus else step
            elapsed = step.to(torch.promote_types(step.dtype, A.dtype)).cumsum(dim=-1)  # [batch, D, C]
            decay = (A[:, None, :] * elapsed[..., None]).exp()  # [batch, D, C, N]: to each token
            decay = decay if split is None else decay * split[0][:, None, :, None]  # 0 after a start
            outs.append((y0, decay, C[..., rows]))
            decays.append(decay[:, :, -1].reshape(batch, channels * N, 1, 1))  # a
            maps.append(final.reshape(batch, channels * N, 1, 1).to(decay.dtype))  # B
        # [batch, k, D, N]: the state each local chunk starts from
        states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), self.group, layout=self.layout)
        states = states.reshape(batch, len(outs), channels, N)
        out = []
        for i, (y0, decay, c) in enumerate(outs):
            carried = decay * states[:, i, :, None, :]  # [batch, D, C, N]
            out.append(y0 + torch.einsum("bdtn,bnt->bdt", carried, c.to(carried.dtype)))  # [batch, D, C]
        out = out[0] if len(out) == 1 else torch.cat(out, dim=-1)  # [batch, D, L]
        return out if z is None else out * torch.nn.functional.silu(z)


class LightningAttention:
    """MiniMax's lightning attention, context-parallel: per head a decayed linear attention,
    S_t = exp(-s) S_{t-1} + k_t^T v_t and o_t = q_t S_t, with S [D, D] and s the head's decay rate
    (the module's `slope_rate`), computed in blocks of `block_size` as the module does. Over a
    chunk of C tokens the state is an affine map, S_out = exp(-s C) S_in + B (B: the chunk's final
    state from zero), and o_t = o0_t + exp(-s (t + 1)) q_t S_in (o0: the outputs from zero; t the
    token's place in the chunk, 0 first). So each local chunk runs the module's block loop from
    zero (`from_zero`), gather_state folds the earlier chunks' (exp(-s C), B) with S as [1, D * D],
    and the correction is added before the module's norm over the heads (which is not linear),
    gate and output projection. The decays are the module's buffers, in their dtype (at least
    float32). An unsharded call runs the module's own forward."""

    def __init__(self, module, group, layout):
        self.module, self.group, self.layout, self.packed = module, group, layout, Packed(group)

    def __call__(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        m = self.module
        if self.packed.aside():  # an unsharded call: the module's own forward
            forward = type(m).forward
            return forward(m, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        check_stateless((), past_key_values)
        n, r, (batch, L, _) = _group.world_size(self.group), _group.rank(self.group), hidden_states.shape
        H = m.num_attention_heads
        qkv = m.act_fn(m.qkv_proj(hidden_states))  # [B, L, 3 H D]
        if attention_mask is not None:  # [B, L]: q, k and v zero at padding, as the module's
            qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
        q, k, v = qkv.reshape(batch, L, H, -1).transpose(1, 2).chunk(3, dim=-1)  # [B, H, L, D] each
        rate = m.slope_rate.to(torch.promote_types(m.slope_rate.dtype, torch.float32))  # [H, 1, 1]
        outs, decays, maps, first = [], [], [], self.packed.first_rows()
        for w in ShardPlan.of(self.layout, n, r, L).windows(0):
            rows = w.queries
            C = rows.stop - rows.start
            split = pieces(first, w.start, w.end)
            if split is None:
                o0, final = from_zero(
                    m, q[:, :, rows], k[:, :, rows], v[:, :, rows]
                )  # [B, H, C, D], [.., D, D]
            else:
                start = rows.start
                o0, final = by_piece(
                    lambda b, lo, hi, _, s=start: from_zero(
                        m, *(x[b : b + 1, :, s + lo : s + hi] for x in (q, k, v))
                    ),
                    split[1],
                    dim=2,
                )
            places = torch.arange(1, C + 1, device=q.device, dtype=rate.dtype)[:, None]  # [C, 1]
            decay = (-rate * places).exp().expand(batch, H, C, 1)  # exp(-s (t + 1)); 0 after a start
            decay = decay if split is None else decay * split[0][:, None, :, None]
            outs.append((o0, q[:, :, rows], decay))
            decays.append(decay[:, :, -1:])  # [B, H, 1, 1]: exp(-s C) (0 after a start)
            maps.append(final.reshape(batch, H, 1, -1).to(rate.dtype))  # [B, H, 1, D * D]: B
        # [B, k, H, D, D]: the state each local chunk starts from
        states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), self.group, layout=self.layout)
        states = states.reshape(batch, len(outs), H, *final.shape[-2:])
        out = [
            o0 + torch.matmul(q_w.to(rate.dtype) * decay, states[:, i]).to(o0.dtype)  # [B, H, C, D]
            for i, (o0, q_w, decay) in enumerate(outs)
        ]
        out = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [B, H, L, D]
        out = m.norm(out.transpose(1, 2).reshape(batch, L, -1))  # [B, L, H D]
        out = torch.sigmoid(m.output_gate(hidden_states)) * out
        return m.out_proj(out), None


def from_zero(m, q, k, v):
    """MiniMax lightning attention's block loop (transformers' MiniMaxLightningAttention.forward,
    without a cache) over one chunk from a zero state, with the module's decay buffers: the
    outputs [B, H, C, D] and the final state [B, H, D, D]."""
    B, H, C, D = q.shape
    state = q.new_zeros(B, H, D, D)
    outs = []
    for start in range(0, C, m.block_size):
        size = min(m.block_size, C - start)
        qb, kb, vb = (x[:, :, start : start + size] for x in (q, k, v))  # [B, H, size, D]
        intra = torch.matmul(
            torch.matmul(qb, kb.transpose(-1, -2)) * m.diagonal_decay[:, :, :size, :size], vb
        )
        outs.append(torch.matmul(qb * m.query_decay[:, :size], state) + intra)
        step = torch.matmul((kb * m.key_decay[:, -size:]).transpose(-1, -2), vb)  # [B, H, D, D]
        state = state * torch.exp(-m.slope_rate * size) + step
    return torch.cat(outs, dim=2), state


class ConvModuleHalo:
    """A causal depthwise nn.Conv1d (padding K - 1 on both sides, its caller keeping the first L
    outputs: RecurrentGemma's) over each local chunk's K - 1 preceding inputs, by hooks on the
    module: before, its input [B, C, L] becomes the halo and the chunks ([B, C, T]); after, its
    first T outputs (the causal ones) are cut to the chunks' own [B, C, L]. The inputs travel as
    the sending rank computed them, as in ConvHalo."""

    def __init__(self, conv, group, layout):
        self.group, self.layout, self.lengths, self.packed = group, layout, [], Packed(group)
        conv.register_forward_pre_hook(self.before)
        conv.register_forward_hook(self.after, always_call=True)

    def before(self, conv, args):
        (x,) = args  # [B, C, L]
        if self.packed.aside():  # an unsharded call: the module as it is
            self.lengths.append(None)
            return None
        self.lengths.append(x.shape[-1])
        halo = gather_halo(x.transpose(1, 2), self.group, conv.kernel_size[0] - 1, layout=self.layout)
        return (halo.transpose(1, 2),)  # [B, C, T]

    def after(self, conv, args, out):
        L = self.lengths.pop()
        if L is None or out is None:  # passed through, or the forward raised
            return None
        n, r, T = _group.world_size(self.group), _group.rank(self.group), args[0].shape[-1]
        causal = out[..., :T]  # [B, C, T]: the last K - 1 outputs read the right padding
        windows = ShardPlan.of(self.layout, n, r, L).windows(conv.kernel_size[0] - 1)
        first = self.packed.first_rows()
        if first is None:
            kept = [causal[:, :, w.own] for w in windows]  # [B, C, L/k] each
        else:  # packed documents: each tap within its output's document
            weight = conv.weight[:, 0]  # [C, K]
            kept = [conv_by_document(args[0][:, :, w.segment], weight, conv.bias, w, first) for w in windows]
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)  # [B, C, L]


class DiagonalScan:
    """RecurrentGemma's RG-LRU scan (`_rnn_scan`: h_t = a_t * h_{t-1} + x_t per channel, a_t zero
    where the position restarts) over each local chunk, corrected by the state the earlier chunks
    leave: over a chunk S_out = a S_in + B with a the product of its a_t, and h_t = h0_t +
    (a_1 ... a_t) S_in (h0: from zero). One run of the module's scan from zero gives h0 and B;
    gather_state folds each channel's (a, B) as a 1 x 1 map. The products are taken in the scan's
    accumulation dtype."""

    def __init__(self, scan, group, layout, packed):
        self.scan, self.group, self.layout, self.packed = scan, group, layout, packed  # the conv's Packed

    def __call__(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
        # hidden_states, recurrent_gate: [B, L, W]; reset: bool [B, L, 1]
        if self.packed.aside():  # an unsharded call: the module's own scan
            return self.scan(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        check_stateless((), recurrent_states)
        n, r, (batch, L, W) = _group.world_size(self.group), _group.rank(self.group), hidden_states.shape
        outs, decays, maps = [], [], []
        for w in ShardPlan.of(self.layout, n, r, L).windows(0):
            rows = w.queries
            h0, final = self.scan(
                hidden_states[:, rows], recurrent_gate[:, rows], reset[:, rows], None, acc_dtype
            )
            carried = (recurrent_gate[:, rows] * ~reset[:, rows]).to(acc_dtype).cumprod(dim=1)  # [B, C, W]
            outs.append((h0, carried))
            decays.append(carried[:, -1].reshape(batch, W, 1, 1))  # a
            maps.append(final.reshape(batch, W, 1, 1).to(acc_dtype))  # B
        # [B, k, W]: the state each local chunk starts from
        states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), self.group, layout=self.layout)
        states = states.reshape(batch, len(outs), W)
        out = [(h0 + carried * states[:, i, None, :]).to(h0.dtype) for i, (h0, carried) in enumerate(outs)]
        out = out[0] if len(out) == 1 else torch.cat(out, dim=1)  # [B, L, W]
        return out, None


KERNELS = {  # chunked kernel -> (the recurrence it computes, its CP version)
    "torch_chunk_gated_delta_rule": ("Gated DeltaNet", ChunkState),
    "chunk_kimi_delta_attention": ("Kimi Delta Attention", ChunkState),
    "mamba2_chunk_scan": ("Mamba2 (SSD)", MambaScan),
    "mamba_selective_scan": ("Mamba (selective scan)", SelectiveScan),
}
