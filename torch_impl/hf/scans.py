"""The diagonal recurrences made CP by their own scans (torch_impl.hf.recurrent's affine-map
scheme, with the map read off the decays instead of widened values): Mamba2's chunked scan
(MambaScan), Mamba's selective scan (SelectiveScan), MiniMax's lightning attention, whose block
loop is inline in its forward (LightningAttention), and RecurrentGemma's recurrent block, an
nn.Conv1d and the RG-LRU's scan (ConvModuleHalo, DiagonalScan). Each states only its map and its
correction; `over_chunks`, which torch_impl.hf.recurrent's ChunkState shares, runs them: per local
chunk from zero (per document piece in packed rows), the chunks' maps folded with gather_state,
then each chunk corrected by the state it starts from."""

import torch

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import check_stateless
from torch_impl.hf.documents import Packed, by_piece, conv_by_document, pieces
from torch_impl.layout import ShardPlan
from torch_impl.state import gather_state


def over_chunks(group, layout, L, chunk, correct, dim):
    """What every linear recurrence here does over a rank's L rows: `chunk(w)` runs the model's own
    kernel over the local chunk w (a Window) from zero, per document piece in packed rows, and
    returns (what the correction needs, A, B), the chunk's map S_out = A S_in + B ([B, H, m, m],
    [B, H, m, d]); gather_state gives each chunk the state S_in [B, H, m, d] that the earlier
    chunks leave, and `correct(kept, S_in)` the chunk's outputs, concatenated along `dim`."""
    kept, decays, maps = [], [], []
    for w in ShardPlan.of(layout, _group.world_size(group), _group.rank(group), L).windows(0):
        k, a, b = chunk(w)
        kept.append(k)
        decays.append(a)
        maps.append(b)
    states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), group, layout=layout)
    out = [correct(k, states[:, i]) for i, k in enumerate(kept)]
    return out[0] if len(out) == 1 else torch.cat(out, dim=dim)


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
        (batch, L, H, P), N = hidden_states.shape, B.shape[-1]
        discrete = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        first = self.packed.first_rows()

        def chunk(w):
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
            a, b = reached[:, -1][..., None, None], final.reshape(batch, H, 1, P * N)  # [B, H, 1, 1 | P N]
            return (y0, reached, C[:, rows]), a, b

        def correct(kept, state):  # state [B, H, 1, P * N]: the one this chunk starts from
            y0, reached, c = kept
            c = c.float().repeat_interleave(H // c.shape[2], dim=2) * reached[..., None]  # [B, C, H, N]
            return y0 + torch.einsum("bthn,bhpn->bthp", c, state.reshape(batch, H, P, N))  # [B, C, H, P]

        return over_chunks(self.group, self.layout, L, chunk, correct, dim=1)  # [B, L, H, P]


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
        (batch, channels, L), N = u.shape, A.shape[-1]
        first = self.packed.first_rows()

        def chunk(w):
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
            a = decay[:, :, -1].reshape(batch, channels * N, 1, 1)
            return (y0, decay, C[..., rows]), a, final.reshape(batch, channels * N, 1, 1).to(decay.dtype)

        def correct(kept, state):  # state [batch, D * N, 1, 1]: the one this chunk starts from
            y0, decay, c = kept
            carried = decay * state.reshape(batch, channels, N)[:, :, None, :]  # [batch, D, C, N]
            return y0 + torch.einsum("bdtn,bnt->bdt", carried, c.to(carried.dtype))  # [batch, D, C]

        out = over_chunks(self.group, self.layout, L, chunk, correct, dim=-1)  # [batch, D, L]
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
    float32). An unsharded call runs the module's own forward. A restatement of transformers'
    MiniMaxLightningAttention.forward: its kind refuses a layer where the installed source is not
    the one restated here (torch_impl.hf.upstream)."""

    def __init__(self, module, group, layout):
        self.module, self.group, self.layout, self.packed = module, group, layout, Packed(group)

    def __call__(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        m = self.module
        if self.packed.aside():  # an unsharded call: the module's own forward
            forward = type(m).forward
            return forward(m, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        check_stateless((), past_key_values)
        (batch, L, _), H = hidden_states.shape, m.num_attention_heads
        qkv = m.act_fn(m.qkv_proj(hidden_states))  # [B, L, 3 H D]
        if attention_mask is not None:  # [B, L]: q, k and v zero at padding, as the module's
            qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
        q, k, v = qkv.reshape(batch, L, H, -1).transpose(1, 2).chunk(3, dim=-1)  # [B, H, L, D] each
        rate = m.slope_rate.to(torch.promote_types(m.slope_rate.dtype, torch.float32))  # [H, 1, 1]
        first = self.packed.first_rows()

        def chunk(w):
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
            # a: [B, H, 1, 1], exp(-s C) (0 after a start); B: [B, H, 1, D * D]
            return (o0, q[:, :, rows], decay), decay[:, :, -1:], final.reshape(batch, H, 1, -1).to(rate.dtype)

        def correct(kept, state):  # state [B, H, 1, D * D]: the one this chunk starts from
            o0, q_w, decay = kept
            state = state.reshape(batch, H, q_w.shape[-1], -1)  # [B, H, D, D]
            return o0 + torch.matmul(q_w.to(rate.dtype) * decay, state).to(o0.dtype)  # [B, H, C, D]

        out = over_chunks(self.group, self.layout, L, chunk, correct, dim=2)  # [B, H, L, D]
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
        batch, L, W = hidden_states.shape

        def chunk(w):
            rows = w.queries
            h0, final = self.scan(
                hidden_states[:, rows], recurrent_gate[:, rows], reset[:, rows], None, acc_dtype
            )
            carried = (recurrent_gate[:, rows] * ~reset[:, rows]).to(acc_dtype).cumprod(dim=1)  # [B, C, W]
            a, b = carried[:, -1].reshape(batch, W, 1, 1), final.reshape(batch, W, 1, 1).to(acc_dtype)
            return (h0, carried), a, b

        def correct(kept, state):  # state [B, W, 1, 1]: the one this chunk starts from
            h0, carried = kept
            return (h0 + carried * state.reshape(batch, 1, W)).to(h0.dtype)  # [B, C, W]

        return over_chunks(self.group, self.layout, L, chunk, correct, dim=1), None  # [B, L, W]
