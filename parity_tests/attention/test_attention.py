"""torch_impl.attention: one rank's causal attention, against a brute-force statement of the rule
and against the dense-mask path it replaces.

A rank's queries sit at global rows q_start .. q_start + L - 1 and its keys at k_start .. q_start +
L - 1 (a halo, or a gathered prefix, followed by its own rows). The brute force builds the dense
[L, T] visibility matrix from the rule itself (k <= q, q - k < window, same document, key not
padding), takes the float64 softmax, and gives zeros to a query that sees nothing. Inputs are
small integers, so every score is exact and only the softmax rounds: its normalising sum and the
weighted sum of values each add up to T terms in another order (tiles merged by log-sum-exp against
one dense row), each within T u64 of the sum of the magnitudes it adds (for the output, weights
summing to 1 times values: at most max|v|), so the two sides are within about 2 * 2T u64 max|v|,
plus each weight's exp, which carries its argument's rounding times |score| (`float64_bound`);
backward adds two more such sums (dP and the row sums of P dP), 2 * 4T u64 of each gradient's
largest entry. Small tile sizes force many tiles (diagonal, full, banded and masked ones, merged by
log-sum-exp) at small shapes. Soft-capping (Gemma 2) and sinks (GPT-OSS) are stated as their
models state them: cap * tanh(score / cap) before the mask, and a per-head logit concatenated to
every row's scores whose softmax column is then dropped.
"""

import math

import pytest
import torch

from parity_tests.harness import bounds
from torch_impl import attention
from torch_impl.attention import kernels
from torch_impl.attention.plan import tile_plan


def float64_bound(sums, T, scale, scores):
    """`sums` sums of T terms, each in another order on the two sides, and each softmax weight's own
    rounding: exp(x) carries its argument's error times |x|, up to twice the largest |score| (the
    max subtracted), plus the scale, the subtraction, exp and the division:
    2 (sums T + 2 max|score| + 4) u64 of the terms' scale."""
    return 2 * (sums * T + 2 * scores + 4) * bounds.u(torch.float64) * scale.abs().max().item()


def largest_score(q, k, scale):
    """max |q . k| * scale over the pairs, bounded by the inputs' largest entries (D products)."""
    return scale * q.shape[-1] * q.abs().max().item() * k.abs().max().item()


# (L, halo h, window, B, H, Hkv, documents, padding): a window spans the halo of 1-3 "shards" of L
CASES = [
    (24, 0, None, 2, 4, 2, False, False),  # rank 0 of a global layer
    (24, 72, None, 2, 4, 2, False, False),  # rank 3 of 4: the whole prefix
    (24, 72, None, 1, 4, 1, False, False),  # one KV head for 4 query heads
    (24, 9, 10, 2, 4, 2, False, False),  # a window within the previous shard
    (24, 47, 48, 2, 4, 2, False, False),  # a window spanning two shards
    (24, 71, 72, 2, 2, 2, False, False),  # three shards, no GQA
    (24, 72, None, 2, 4, 2, True, False),  # packed documents over the prefix
    (24, 72, None, 2, 4, 2, True, True),  # documents and padding
    (24, 20, 21, 2, 4, 2, True, True),
    (24, 20, 21, 2, 4, 2, False, True),
    (17, 0, 5, 2, 2, 1, True, True),  # L not a multiple of the tile size
    (24, 72, None, 2, 4, 2, "returning", False),  # a document's ids that come back after another's
    (24, 20, 21, 2, 4, 2, "returning", True),
]


def brute_force(q, k, v, q_start, k_start, window, scale, documents, padding, softcap=None, sinks=None):
    """float64 attention over the dense [L, T] visibility matrix made from the rule."""
    B, H, L, _ = q.shape
    T, groups = k.shape[2], H // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [B, H, T, D]
    qpos = torch.arange(q_start, q_start + L)[:, None]  # [L, 1] global rows
    kpos = torch.arange(k_start, k_start + T)[None]  # [1, T]
    seen = (kpos <= qpos).expand(B, L, T)  # [B, L, T]
    if window is not None:
        seen = seen & (qpos - kpos < window)
    if documents is not None:
        seen = seen & (documents[:, -L:, None] == documents[:, None, :])
    if padding is not None:
        seen = seen & padding[:, None, :]
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, L, T]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen[:, None], -math.inf)
    if sinks is not None:  # GPT-OSS: the sink's column joins the softmax, then is dropped
        logits = torch.cat([scores, sinks[None, :, None, None].expand(B, H, L, 1)], dim=-1)
        return logits.softmax(-1)[..., :-1] @ v
    weights = torch.where(seen[:, None].any(-1, keepdim=True), scores.softmax(-1), 0.0)
    return weights @ v


def dense_path(q, k, v, q_start, k_start, window, scale, documents, padding):
    """torch_impl.hf's old math: SDPA on the dense [B, 1, L, T] bool mask of the rule (rows that see
    nothing: zeros, as the rule says; SDPA would give NaN)."""
    B, H, L, _ = q.shape
    T = k.shape[2]
    rule = attention.mask_mod(q_start, k_start, window, documents, padding)
    seen = rule(
        torch.arange(B)[:, None, None], None, torch.arange(L)[None, :, None], torch.arange(T)[None, None]
    )
    seen = seen.expand(B, L, T)[:, None]  # [B, 1, L, T]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=seen, scale=scale, enable_gqa=True
    )
    return torch.where(seen.any(-1, keepdim=True), out, 0.0)


def make_inputs(L, h, B, H, Hkv, documents, padding, seed=0, dtype=torch.float64):
    """Integer-valued q, k, v in [-3, 3] ([B, H, L, D] and [B, Hkv, T, D], from [B, L, H, D] memory
    as models lay them out), sorted document ids (documents="returning": row 0's ids alternate in
    runs of 6, 0 0 0 0 0 0 1 1 1 1 1 1 0 ...: the rule only asks equal ids) and a padding mask with
    20% padding."""
    gen = torch.Generator().manual_seed(seed)
    T, D = h + L, 8

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=gen).to(dtype).transpose(1, 2).requires_grad_()

    q, k, v = ints(B, L, H, D), ints(B, T, Hkv, D), ints(B, T, Hkv, D)
    docs = torch.randint(0, 4, (B, T), generator=gen).sort(-1).values if documents else None
    if documents == "returning":
        docs[0] = torch.arange(T) // 6 % 2
    pad = torch.rand(B, T, generator=gen) > 0.2 if padding else None
    return q, k, v, docs, pad


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(attention.plan, "BLOCK", {"global": 7, "window": 5, "masked": 6})


def score_bound(q, k, scale, softcap, sinks):
    """The largest |logit| an exp takes (float64_bound's `scores`): q . k * scale, or under a cap
    at most the cap, whose tanh adds 3 roundings (divide, tanh, multiply) of it; or a sink's."""
    scores = largest_score(q, k, scale) if softcap is None else 4 * min(softcap, largest_score(q, k, scale))
    return scores if sinks is None else max(scores, sinks.abs().max().item())


# what joins the rule: Gemma 2's soft-capping at 2 (integer scores reach 18: heavily capped), GPT-OSS's
# sinks (integer logits per head), or both
EXTRAS = {"plain": (None, False), "softcap": (2.0, False), "sinks": (None, True), "both": (1.5, True)}


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("case", CASES)
def test_matches_brute_force_forward_and_backward(case, extra, small_tiles):
    L, h, window, B, H, Hkv, documents, padding = case
    softcap, with_sinks = EXTRAS[extra]
    q_start = 1000  # any global row: only differences matter
    q, k, v, docs, pad = make_inputs(L, h, B, H, Hkv, documents, padding)
    sinks = torch.arange(H, dtype=torch.float64).sub(1).requires_grad_() if with_sinks else None
    kwargs = dict(window=window, scale=0.25, documents=docs, padding=pad, softcap=softcap, sinks=sinks)
    out = attention.causal_attention(q, k, v, q_start, q_start - h, **kwargs)
    ref = brute_force(q, k, v, q_start, q_start - h, window, 0.25, docs, pad, softcap, sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    T, scores = h + L + with_sinks, score_bound(q, k, 0.25, softcap, sinks)
    bounds.check((out - ref).abs().max(), float64_bound(2, T, v, scores), "output")
    if extra == "plain":  # what torch_impl.hf did before: sdpa on an [L, T] mask
        dense = dense_path(q, k, v, q_start, q_start - h, window, 0.25, docs, pad)
        bound = float64_bound(2, T, v, scores)
        bounds.check((out - dense).abs().max(), bound, "output against the dense path")
    cotangent = torch.randint(-2, 3, out.shape, generator=torch.Generator().manual_seed(1)).double()
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    grads = torch.autograd.grad(out, inputs, cotangent)
    expected = torch.autograd.grad(ref, inputs, cotangent)
    for name, got, want in zip("qkv", grads, expected, strict=False):
        bounds.check((got - want).abs().max(), float64_bound(4, T, want, scores), f"grad of {name}")
    if with_sinks:  # -sum over B * L rows of the sink's weight (<= 1) times dO . out (D products)
        most = B * L * q.shape[-1] * cotangent.abs().max().item() * v.abs().max().item()
        bound = float64_bound(4, T + q.shape[-1], torch.tensor(most), scores)
        bounds.check((grads[3] - expected[3]).abs().max(), bound, "grad of the sinks")


def test_queries_that_see_nothing_give_zeros_and_no_gradient(small_tiles):
    """Rank 0's first tokens padded: their queries see no key; everything else is unaffected."""
    q, k, v, _, _ = make_inputs(12, 0, 1, 2, 1, False, False)
    padding = torch.ones(1, 12, dtype=torch.bool)
    padding[0, :3] = False
    out = attention.causal_attention(q, k, v, 0, 0, padding=padding)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    ref = brute_force(q, k, v, 0, 0, None, 1 / math.sqrt(8), None, padding)
    bound = float64_bound(2, 12, v, largest_score(q, k, 1 / math.sqrt(8)))
    bounds.check((out - ref).abs().max(), bound, "output")
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :3], torch.zeros_like(q.grad[:, :, :3]))
    assert torch.isfinite(k.grad).all() and torch.equal(k.grad[:, :, :3], torch.zeros_like(k.grad[:, :, :3]))


def test_a_sink_alone_gives_zeros_and_its_gradient_from_the_other_rows(small_tiles):
    """Queries that see no key but a sink: output zero (its softmax puts all weight on the sink,
    which has no value), no gradient to q; the sinks' gradient, from the rows that see keys, right."""
    q, k, v, _, _ = make_inputs(12, 0, 1, 2, 1, False, False)
    padding = torch.ones(1, 12, dtype=torch.bool)
    padding[0, :3] = False
    sinks = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    out = attention.causal_attention(q, k, v, 0, 0, padding=padding, softcap=3.0, sinks=sinks)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    ref = brute_force(q, k, v, 0, 0, None, 8**-0.5, None, padding, 3.0, sinks)
    scores = score_bound(q, k, 8**-0.5, 3.0, sinks)
    bounds.check((out - ref).abs().max(), float64_bound(2, 13, v, scores), "output")
    cotangent = torch.ones_like(out)
    (got,) = torch.autograd.grad(out, sinks, cotangent, retain_graph=True)
    (want,) = torch.autograd.grad(ref, sinks, cotangent)
    most = 12 * 8 * v.abs().max().item()
    bounds.check((got - want).abs().max(), float64_bound(4, 13 + 8, torch.tensor(most), scores), "sinks")
    assert want.abs().min() > 0.1  # the rows that see keys pull every sink down
    (grad_q,) = torch.autograd.grad(out, q, cotangent)
    assert torch.equal(grad_q[:, :, :3], torch.zeros_like(grad_q[:, :, :3]))


@pytest.mark.parametrize("extra", ["plain", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_floats_and_low_precision_keep_the_dtype(dtype, extra, small_tiles):
    """Random floats against the float64 brute force; the output is in the input's dtype. The
    low-precision side rounds q, k and v (scores of D = 16 products move by up to 2u of their
    magnitudes, ~|q||k|/4 here, so weights by about as much), sums T = 40 terms twice, and rounds the
    output: float32 (u = 2^-24) to 2 (2T + D) u of max|v|; bfloat16 (u = 2^-8, whose flash kernel
    accumulates in float32, so only the roundings of q, k, v and the output count) to 8 u max|v|.
    bfloat16's difference is those few roundings themselves, so it sits near its bound by nature
    (measured 0.13 of it): this test is for the dtype and a low-precision path that runs; exactness
    is the integer-valued float64 tests' job. With a soft-cap (scores within the cap: the cap's
    tanh moves them by no more than the uncapped ones) and sinks in the input's dtype, whose
    rounding (bfloat16: u of |s| <= 1) moves each weight by as much: one u more."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 24, 16, generator=gen)
    k, v = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    docs = torch.randint(0, 3, (2, 40), generator=gen).sort(-1).values
    softcap, sinks = (None, None) if extra == "plain" else (2.0, torch.rand(4, generator=gen) * 2 - 1)
    low = None if sinks is None else sinks.to(dtype)
    out = attention.causal_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), 100, 84, window=30, documents=docs, softcap=softcap, sinks=low
    )
    ref = brute_force(
        q.double(),
        k.double(),
        v.double(),
        100,
        84,
        30,
        0.25,
        docs,
        None,
        softcap,
        None if low is None else low.double(),
    )
    assert out.dtype == dtype
    c = 2 * (2 * 40 + 16) if dtype == torch.float32 else 8 + (extra != "plain")
    bounds.check((out.double() - ref).abs().max(), c * bounds.u(dtype) * v.abs().max().item(), "output")


# --- the plan -----------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 3, 8, 13, 40])
@pytest.mark.parametrize("masked,merge", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("L,h", [(1, 0), (16, 0), (16, 5), (16, 30), (13, 47)])
def test_tile_plan_covers_every_visible_pair_exactly_once(L, h, window, masked, merge):
    """Tiles do not overlap and every visible (query, key) pair lies in one; no tile sees nothing;
    "full" tiles see every pair and "causal" ones are diagonal squares; a tile with a mask is at
    most a block square, so no mask grows with L * T, and unmerged (soft-capped: explicit scores)
    none is."""
    T, block = h + L, 4
    rule = attention.mask_mod(h, 0, window, None, None)
    covered = torch.zeros(L, T, dtype=torch.long)
    for q0, q1, tiles in tile_plan(L, T, window, block, masked, merge=merge):
        for t in tiles:
            assert (t.q0, t.q1) == (q0, q1) and 0 <= t.k0 < t.k1 <= T
            pairs = rule(0, 0, torch.arange(q0, q1)[:, None], torch.arange(t.k0, t.k1)[None])
            assert pairs.any(), t
            if t.kind == "full":
                assert pairs.all() and not masked, t
            elif t.kind == "causal":
                assert t.k0 == q0 + h and t.k1 == q1 + h and not masked, t
            else:
                assert (q1 - q0) <= block and t.k1 - t.k0 <= block, t
            assert merge or t.k1 - t.k0 <= block, t
            covered[q0:q1, t.k0 : t.k1] += 1
    visible = rule(0, 0, torch.arange(L)[:, None], torch.arange(T)[None])
    assert covered.max() <= 1 and torch.equal(covered.bool() & visible, visible)


def packed_documents(B, T, seed):
    """int [B, T]: runs of ids, documents of 1 to 9 tokens (one-token ones included)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths = torch.randint(1, 10, (T,), generator=gen)
        rows.append(torch.repeat_interleave(torch.arange(T), lengths)[:T])
    return torch.stack(rows)


@pytest.mark.parametrize("window", [None, 3, 13])
@pytest.mark.parametrize("L,h", [(1, 0), (16, 0), (16, 5), (13, 47)])
def test_tile_plan_skips_tiles_across_documents(L, h, window):
    """With packed documents' spans: no tile lies wholly outside every query's document, every
    pair a query sees (in some row of the batch) is in exactly one tile, and a tile is unmasked
    ("full", "causal") only where each row's queries see it whole (the square: causally)."""
    T, block = h + L, 4
    for seed in range(4):
        docs = packed_documents(2, T, seed)
        spans = attention.plan.document_spans(docs, L, block)
        rule = attention.mask_mod(h, 0, window, docs, None)
        b = torch.arange(2)[:, None, None]
        covered = torch.zeros(L, T, dtype=torch.long)
        for q0, q1, tiles in tile_plan(L, T, window, block, False, spans):
            for t in tiles:
                pairs = rule(b, 0, torch.arange(q0, q1)[None, :, None], torch.arange(t.k0, t.k1)[None, None])
                assert pairs.any(), (seed, t)
                if t.kind == "full":
                    assert pairs.all(), (seed, t)
                elif t.kind == "causal":
                    assert torch.equal(pairs, torch.ones_like(pairs[0]).tril().expand_as(pairs)), (seed, t)
                else:
                    assert (q1 - q0) <= block and t.k1 - t.k0 <= block, t
                covered[q0:q1, t.k0 : t.k1] += 1
        visible = rule(b, 0, torch.arange(L)[None, :, None], torch.arange(T)[None, None]).any(0)
        assert covered.max() <= 1 and torch.equal(covered.bool() & visible, visible)


@pytest.mark.parametrize("L,h,block", [(1, 0, 4), (16, 0, 4), (16, 5, 4), (13, 47, 4), (16, 5, 16)])
def test_spans_from_the_callers_starts_are_the_ids_scan(L, h, block):
    """Packed rows whose keys begin mid-row (documents cut off before the first key): the spans
    planned from each query's document start by global row (what the hf context finds once a
    forward over the whole rows) are those found by scanning the keys' ids."""
    from torch_impl.layout import document_starts

    for seed in range(4):
        ids = packed_documents(2, 20 + h + L, seed)  # [B, S]: the whole rows
        k_start = 20
        starts = document_starts(ids)[:, k_start + h :]  # [B, L]: global rows
        keys = ids[:, k_start:]  # [B, T]
        scanned = attention.plan.document_spans(keys, L, block)
        assert attention.plan.document_spans(keys, L, block, starts - k_start) == scanned, seed


@pytest.mark.parametrize("window", [None, 5])
def test_document_starts_give_the_same_attention_and_scan_no_ids(monkeypatch, window, small_tiles):
    """causal_attention handed its queries' document starts: the same output and gradients, bit for
    bit (the same plan), forward and backward without scanning the ids."""
    from torch_impl.attention import plan
    from torch_impl.layout import document_starts

    B, L, T, k_start = 2, 16, 40, 7
    ids = packed_documents(B, k_start + T, 1)  # [B, S]
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-2, 3, (B, 4, L, 8), generator=gen).double()
    k, v = (torch.randint(-2, 3, (B, 2, T, 8), generator=gen).double() for _ in range(2))
    cotangent = torch.randint(-2, 3, (B, 4, L, 8), generator=gen).double()
    starts = document_starts(ids)[:, -L:]  # [B, L]: by global row
    scans, scan = [], plan.document_starts
    monkeypatch.setattr(plan, "document_starts", lambda t: scans.append(1) or scan(t))
    results = []
    for given in (None, starts):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention.causal_attention(
            *leaves,
            k_start + T - L,
            k_start,
            window=window,
            documents=ids[:, k_start:],
            document_starts=given,
        )
        out.backward(cotangent)
        results.append([out.detach()] + [t.grad for t in leaves])
        assert len(scans) == (2 if given is None else 0), len(scans)  # forward and backward
        scans.clear()
    for scanned, planned in zip(*results, strict=True):
        assert torch.equal(scanned, planned)


def test_a_skipped_tile_is_never_computed():
    """The fused CPU op sees only the planned tiles' keys, forward and backward: on packed rows
    whose queries' documents start late, a fraction of the unskipped plan's, and exact."""
    from cp_support.memory import SeesInside

    class KeyRows(SeesInside):
        rows = 0

        def op(self, func, args, kwargs):
            if "flash_attention_for_cpu" in str(func):
                KeyRows.rows += args[2].shape[2]  # the tile's keys (forward and backward: args[2])
            return func(*args, **kwargs)

    L, T, block = 512, 2048, attention.plan.BLOCK["masked"]
    docs = torch.cat([torch.zeros(T - 600, dtype=torch.long), torch.ones(600, dtype=torch.long)])[None]
    docs = docs.expand(2, -1).clone()  # every query's document starts at key row T - 600
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, L, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 1, T, 8, generator=gen, requires_grad=True) for _ in range(2))
    with KeyRows():
        out = attention.causal_attention(q, k, v, T - L, 0, documents=docs)
        out.sum().backward()
    spans = attention.plan.document_spans(docs, L, block)
    planned = sum(t.k1 - t.k0 for _, _, tiles in tile_plan(L, T, None, block, False, spans) for t in tiles)
    unskipped = sum(t.k1 - t.k0 for _, _, tiles in tile_plan(L, T, None, block, True) for t in tiles)
    assert KeyRows.rows == 2 * planned and planned < unskipped / 2, (KeyRows.rows, planned, unskipped)
    want = brute_force(q.double(), k.double(), v.double(), T - L, 0, None, 8**-0.5, docs, None)
    c = 2 * (2 * 600 + 8)  # as the float32 test above: sums over a query's 600 keys, D = 8 products
    bounds.check(
        (out.double() - want).abs().max(), c * bounds.u(torch.float32) * v.abs().max().item(), "output"
    )


def test_memory_is_bounded_no_tensor_grows_with_L_times_T():
    """Every tensor made in forward and backward, counted by a dispatch mode: the largest holds far
    fewer than L * T elements (the dense path's mask alone has B * L * T; its scores B * H * L * T)."""
    from cp_support.memory import LargestTensor

    L, T = 1024, 8192
    q = torch.randn(1, 2, L, 8, requires_grad=True)
    k, v = torch.randn(1, 1, T, 8, requires_grad=True), torch.randn(1, 1, T, 8, requires_grad=True)
    documents, padding = torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool)
    sinks = torch.zeros(2, requires_grad=True)
    for extra in (
        {},
        {"documents": documents, "padding": padding},
        {"window": 300},
        {"softcap": 5.0, "sinks": sinks},  # explicit scores: a block square per tile
        {"softcap": 5.0, "window": 300, "padding": padding},
    ):
        with LargestTensor() as largest:
            attention.causal_attention(q, k, v, T - L, 0, **extra).sum().backward()
        assert largest.numel <= L * T // 8, (extra.keys(), largest.numel)


def test_bad_arguments_raise_value_error():
    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 12, 8)
    with pytest.raises(ValueError, match=r"k_start \(0\) \+ T \(12\) must equal q_start \(0\) \+ L \(8\)"):
        attention.causal_attention(q, k, k, 0, 0)
    with pytest.raises(ValueError, match="`key`/`value` must be"):
        attention.causal_attention(q, torch.zeros(1, 3, 12, 8), torch.zeros(1, 3, 12, 8), 4, 0)
    with pytest.raises(ValueError, match="`window` must be at least 1"):
        attention.causal_attention(q, k, k, 4, 0, window=0)
    with pytest.raises(ValueError, match=r"`documents` must be \[B, T\] = \(1, 12\)"):
        attention.causal_attention(q, k, k, 4, 0, documents=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="`softcap` must be positive"):
        attention.causal_attention(q, k, k, 4, 0, softcap=0.0)
    with pytest.raises(ValueError, match=r"`sinks` must be \[H\] = \(4,\), one logit per query head"):
        attention.causal_attention(q, k, k, 4, 0, sinks=torch.zeros(2))
    ids = torch.zeros(1, 12, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"`document_starts` must be integer \[B, L\] = \(1, 8\).*without documents"
    ):
        attention.causal_attention(q, k, k, 4, 0, document_starts=torch.zeros(1, 8, dtype=torch.long))
    for starts in (torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 8)):
        with pytest.raises(ValueError, match=r"`document_starts` must be integer \[B, L\] = \(1, 8\)"):
            attention.causal_attention(q, k, k, 4, 0, documents=ids, document_starts=starts)


def test_kernel_table():
    cpu = torch.zeros(1, 1, 1, 8)
    assert attention.choose_kernel(cpu, None, None, None) == "tiled"
    assert attention.choose_kernel(cpu.to("meta"), 4, None, None) == "tiled"


@pytest.mark.slow
def test_the_cuda_rule_runs_through_flex_attention_forward_on_cpu():
    """The CUDA kernels' visibility rule and soft-capping `score_mod`, through flex_attention with
    a BlockMask compiled from `mask_mod` (no dense mask). torch 2.13 has flex's forward on CPU (not
    its backward, nor the log-sum-exp that sinks need): this checks the rule, the offsets, GQA, the
    per-row documents and padding and the cap that CUDA runs."""
    q, k, v, docs, pad = make_inputs(24, 47, 2, 4, 2, True, True, seed=3, dtype=torch.float32)
    q, k, v = (t.detach() for t in (q, k, v))
    for softcap in (None, 2.0):
        out = kernels._KERNELS["flex"](q, k, v, 1000, 953, 48, 0.25, docs, pad, softcap, None, None)
        ref = brute_force(q.double(), k.double(), v.double(), 1000, 953, 48, 0.25, docs, pad, softcap)
        # integer inputs, exact scores: float32 rounds the softmax's two sums of T = 71 terms; a
        # capped score also its 3 roundings of up to the cap (2), which each weight's exp carries
        c = 2 * 71 + (0 if softcap is None else 2 * 3 * softcap)
        bounds.check((out.double() - ref).abs().max(), 2 * c * bounds.u(torch.float32) * 3, "output")
