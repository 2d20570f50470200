"""The CP versions of the functions a chunked recurrence's or short conv's forward calls
(torch_impl.hf.recurrent rebinds them into the model's own forward): its causal conv over each
local chunk's K - 1 preceding inputs (ConvHalo), its chunked kernel from the state the earlier
chunks leave (ChunkState: Gated DeltaNet's and KDA's; Mamba2's and Mamba's are in
torch_impl.hf.scans), and the fused kernels it tries first, declined under CP (Unfused)."""

import torch

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import check_stateless
from torch_impl.hf.documents import Packed, by_piece, conv_by_document, pieces
from torch_impl.hf.scans import over_chunks
from torch_impl.layout import ShardPlan


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
