"""torch_impl.attention.sparse_mla_attention: DeepSeek Sparse Attention's absorbed form against
the model's expanded one (per-head K and V from kv_b_proj) under the mask "selected and visible".

Integer-valued inputs: every score is exact, only the softmax rounds (its sums of k picks, the
weighted sum, the absorbed products), so the bounds are a few k u of the outputs' scale.
"""

import math

import pytest
import torch

from parity_tests.harness import bounds
from torch_impl import attention

# (B, H, L, q_start, k, dn, dr, dv, r): MLA dimensions at test size and GLM-5's nope 192, v 256
MLA_CASES = [
    (2, 3, 10, 4, 5, 8, 4, 6, 16),
    (1, 2, 7, 0, 3, 8, 4, 12, 16),  # rank 0: queries over their own rows only
    (1, 2, 6, 5, 4, 192, 64, 256, 32),
]


def mla_inputs(B, H, L, q_start, k, dn, dr, dv, r, seed=0, dtype=torch.float64):
    """Integer-valued query [B, H, L, dn + dr], latents [B, T, r + dr] and kv_b_proj weight
    [H * (dn + dv), r] in [-2, 2]; each query picks k distinct rows of T = q_start + L, and may
    see those not after itself, minus 20% at random (padding, other documents); query 1 sees none."""
    gen = torch.Generator().manual_seed(seed)
    T = q_start + L

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).to(dtype).requires_grad_()

    query, latents, weight = ints(B, H, L, dn + dr), ints(B, T, r + dr), ints(H * (dn + dv), r)
    indices = torch.rand(B, L, T, generator=gen).argsort(-1)[..., :k].int()  # [B, L, k]
    rows = q_start + torch.arange(L)[None, :, None]
    valid = (indices <= rows) & (torch.rand(B, L, k, generator=gen) > 0.2)
    valid[:, 1] = False
    return query, latents, weight, indices, valid


def expanded_mla(query, latents, weight, indices, valid, dn, scale):
    """The model's own form: per-head K = (W_uk c | rope key) and V = W_uv c of every key row,
    float64 softmax over the dense [L, T] mask of each query's valid picks; zeros if none."""
    (B, H, L, _), (T, r) = query.shape, (latents.shape[1], weight.shape[1])
    w = weight.view(H, -1, r)  # [H, dn + dv, r]
    key_nope = torch.einsum("btr,hdr->bhtd", latents[..., :r], w[:, :dn])  # [B, H, T, dn]
    rope = latents[:, None, :, r:].expand(B, H, T, -1)  # [B, H, T, dr]
    key = torch.cat([key_nope, rope], dim=-1)
    value = torch.einsum("btr,hdr->bhtd", latents[..., :r], w[:, dn:])  # [B, H, T, dv]
    chosen = torch.where(valid, indices.long(), T)
    seen = torch.zeros(B, L, T + 1, dtype=torch.bool).scatter_(-1, chosen, True)[..., :T]  # [B, L, T]
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~seen[:, None], -math.inf)
    weights = torch.where(seen[:, None].any(-1, keepdim=True), scores.softmax(-1), 0.0)
    return (weights @ value).transpose(1, 2)  # [B, L, H, dv]


@pytest.mark.parametrize("case", MLA_CASES)
def test_absorbed_mla_matches_the_expanded_form(case):
    """Forward and the gradients of query, latents and kv_b_proj's weight, over blocks of 3 queries;
    picks a query may not see weigh nothing, a query that sees none gives zeros and no gradient."""
    B, H, L, q_start, k, dn, dr, dv, r = case
    inputs = mla_inputs(*case)
    scale = 0.02
    out = attention.sparse_mla_attention(*inputs, nope_dim=dn, scale=scale, block=3)
    ref = expanded_mla(*inputs, dn, scale)
    assert out.shape == (B, L, H, dv) and out.dtype == torch.float64
    # integer inputs: scores are sums of dn + dr or r products either way (exact); the absorbed form
    # sums r latent terms through the value rows where the expanded one sums them first, and the
    # softmax sums k picks: 2 * (2k + r) u64 relative; backward twice as many sums
    c = 2 * k + r
    bounds.check((out - ref).abs().max(), 2 * c * bounds.u(torch.float64) * ref.abs().max(), "output")
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    grad = torch.randint(-2, 3, out.shape, generator=torch.Generator().manual_seed(1)).double()
    got = torch.autograd.grad(out, inputs[:3], grad)
    want = torch.autograd.grad(ref, inputs[:3], grad)
    for name, g, w in zip(("query", "latents", "weight"), got, want, strict=True):
        bound = 4 * c * bounds.u(torch.float64) * w.abs().max()
        bounds.check((g - w).abs().max(), bound, f"grad of {name}")
    assert torch.equal(got[0][:, :, 1], torch.zeros_like(got[0][:, :, 1]))


@pytest.mark.parametrize("dtype,c", [(torch.float32, 2 * (24 + 32 + 2 * 8)), (torch.bfloat16, 2 * 8)])
def test_absorbed_mla_low_precision_keeps_the_dtype(dtype, c):
    """Random floats against the float64 expanded form, relative to its largest output, c u(dtype):
    float32 sums the scores' dn + dr = 24 and r = 32 products and the softmax's k = 8 picks twice, in
    float32 (2 (24 + 32 + 2k)); bfloat16 rounds each of the 8 tensors on the way (query, latents,
    weight, the absorbed query, scores, weights, the latent sum, the output) to 2^-8, each at most
    one ulp from float64's (2 * 8); those roundings are the whole difference, so it sits near its
    bound by nature (measured 0.24 of it), as in test_random_floats_and_low_precision_keep_the_dtype."""
    case = (2, 4, 16, 32, 8, 16, 8, 16, 32)
    query, latents, weight, indices, valid = mla_inputs(*case)
    gen = torch.Generator().manual_seed(2)
    query, latents, weight = (
        torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (query, latents, weight)
    )
    ref = expanded_mla(query, latents, weight, indices, valid, 16, 16**-0.5)
    low = (t.to(dtype) for t in (query, latents, weight))
    out = attention.sparse_mla_attention(*low, indices, valid, nope_dim=16, scale=16**-0.5, block=5)
    assert out.dtype == dtype
    bounds.check((out.double() - ref).abs().max(), c * bounds.u(dtype) * ref.abs().max(), "output")


def test_absorbed_mla_makes_no_per_head_keys():
    """Every tensor made in forward and backward, counted by a dispatch mode: the largest is far
    smaller than the per-head keys of the prefix (H x T x (dn + dr)) that the expanded form makes."""
    from cp_support.memory import LargestTensor

    B, H, L, T, k, dn, dr, dv, r = 1, 8, 256, 8192, 32, 16, 8, 16, 32
    query = torch.randn(B, H, L, dn + dr, requires_grad=True)
    latents = torch.randn(B, T, r + dr, requires_grad=True)
    weight = torch.randn(H * (dn + dv), r, requires_grad=True)
    indices = torch.randint(0, T - L, (B, L, k), dtype=torch.int32)
    valid = torch.ones(B, L, k, dtype=torch.bool)
    with LargestTensor() as largest:
        attention.sparse_mla_attention(
            query, latents, weight, indices, valid, nope_dim=dn, scale=0.1
        ).sum().backward()
    assert largest.numel <= T * (r + dr) < H * T * (dn + dr) // 4, largest.numel
