"""torch_impl.hf.recurrent: transformers' own linear-attention kernels (Gated DeltaNet's
`torch_chunk_gated_delta_rule`, Kimi Delta Attention's `chunk_kimi_delta_attention`) made CP, against
the same kernel over the whole sequence in one process, forward and backward.

Rank r of n holds the tokens [r*L, (r+1)*L) (head_tail: chunks r and 2n-1-r of L/2), runs the kernel
once per local chunk from the state [0 | I] with values widened by dk zero columns, and receives its
initial state from the earlier chunks through gather_state. The kernels work in chunks of 64 tokens
from each call's first token, so with L = 48 or 80 a rank's kernel chunks straddle one process's.

Exact data: decay 1 (g = 0), beta = 1 and one-hot keys (no l2 norm; dk = 4, so the query scale is
1/2): each token overwrites one row of the state with its value, every value in the kernel is a
small integer or half-integer, and the CP outputs and every gradient equal one process's to the bit;
a state from the wrong rank or chunk, or a misrouted token, changes them. Random data (float32, the
kernels' own precision; l2-normed keys, decays in (0, 1), beta in (0, 1)): every transition is a
contraction, so a rounding error does not grow along the sequence; an output is a sum of at most
S + dk + dv chained roundings of terms no larger than the largest value; the bound asserted is
twice gamma of that many float32 roundings times the largest |value| (outputs) or the largest
|gradient| of the input (gradients), for each side's error.
"""

import pytest
import torch

from parity_tests.harness import bounds, expected
from parity_tests.hf import recurrent_cases

LAYOUTS = ["contiguous", "head_tail"]


def inputs(kind, S, dk=8, dv=12, Hk=1, H=2, B=2, seed=0):
    """Global [B, S, ...] inputs of a kernel; kind "exact" (GDN) or "gdn"/"kda" (random)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "exact":
        dk = 4
        key = torch.nn.functional.one_hot(torch.randint(0, dk, (B, S, Hk), generator=gen), dk).float()
        return {
            "query": torch.randint(-2, 3, (B, S, Hk, dk), generator=gen).float(),
            "key": key,
            "value": torch.randint(-2, 3, (B, S, H, dv), generator=gen).float(),
            "g": torch.zeros(B, S, H),
            "beta": torch.ones(B, S, H),
        }
    gate = (B, S, H, dk) if kind == "kda" else (B, S, H)
    heads = H if kind == "kda" else Hk
    return {
        "query": torch.randn(B, S, heads, dk, generator=gen),
        "key": torch.randn(B, S, heads, dk, generator=gen),
        "value": torch.randn(B, S, H, dv, generator=gen),
        # decays of about exp(-1/32) a token: a state lasts about 100 tokens, across ranks
        "g": -torch.nn.functional.softplus(torch.randn(gate, generator=gen)) / 32,
        "beta": torch.rand(B, S, H, generator=gen),
    }


def run(pool, name, data, n, layout, l2norm, seed=3):
    out = data["value"].shape[:3] + data["value"].shape[-1:]
    cotangent = torch.randint(-2, 3, out, generator=torch.Generator().manual_seed(seed)).float()
    ref = recurrent_cases.one_process(name, data, cotangent, l2norm)
    results = pool.run(("first", n), recurrent_cases.chunk_state, name, data, cotangent, layout, l2norm)[0]
    L = data["query"].shape[1] // n
    return ref, [(expected.local_tokens(n, L, r, layout), res) for r, res in enumerate(results)]


def test_only_a_forwards_global_kernels_make_it_recurrent():
    """kernel_of reads the global names a forward loads (what apply_recurrent replaces), not the
    attributes it reads: a module calling `self.causal_conv1d_fn` is not taken for one whose
    kernels the adapter swaps."""
    from torch import nn

    from torch_impl.hf.recurrent import kernel_of

    def by_attribute(self, x):
        return self.torch_chunk_gated_delta_rule(self.causal_conv1d_fn(x, self.conv1d.weight))

    def by_global(self, x):
        return torch_chunk_gated_delta_rule(causal_conv1d_fn(x, self.conv1d.weight))  # noqa: F821

    modules = {}
    for name, forward in (("attribute", by_attribute), ("global", by_global)):
        cls = type(f"By{name.title()}", (nn.Module,), {"forward": forward})
        modules[name] = cls()
        modules[name].conv1d = nn.Conv1d(4, 4, 3, groups=4)
    assert kernel_of(modules["attribute"]) is None
    assert kernel_of(modules["global"]) == "torch_chunk_gated_delta_rule"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 4])
def test_integer_states_equal_one_process_to_the_bit(pool, n, layout):
    data = inputs("exact", S=320)  # L = 160 or 80
    (ref_out, ref_grads), ranks = run(pool, "gdn", data, n, layout, l2norm=False)
    assert ref_out.abs().max() > 4  # states carry values across ranks
    for rows, (out, grads) in ranks:
        assert torch.equal(out, ref_out[:, rows])
        for key, grad in grads.items():
            assert torch.equal(grad, ref_grads[key][:, rows]), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,n,S", [("gdn", 4, 192), ("kda", 4, 320), ("gdn", 2, 160)])
def test_random_states_equal_one_process(pool, name, n, S, layout):
    """L = 48, 80 or 80 tokens: a rank's kernel chunks of 64 straddle one process's."""
    data = inputs(name, S)
    (ref_out, ref_grads), ranks = run(pool, name, data, n, layout, l2norm=True)
    dk, dv = data["key"].shape[-1], data["value"].shape[-1]
    d, u = S + dk + dv, bounds.u("float32")
    gamma = 2 * d * u / (1 - d * u)
    for rows, (out, grads) in ranks:
        bounds.check((out - ref_out[:, rows]).abs().max(), gamma * data["value"].abs().max(), "outputs")
        for key, grad in grads.items():
            bound = gamma * ref_grads[key].abs().max()
            bounds.check((grad - ref_grads[key][:, rows]).abs().max(), bound, f"grad of {key}")


@pytest.mark.parametrize("family", ["qwen3_5", "zaya"])
def test_a_recurrent_cache_is_refused_on_every_rank(pool, family):
    """Generation would carry each rank's own final state (Zaya: its convs' and delayed values'):
    every rank raises, none hangs."""
    for message in pool.run(("first", 2), recurrent_cases.refusals, family)[0]:
        assert message is not None and "generation with a cache" in message, message


# --- Mamba2 (SSD): a scalar decay per head, the state [head_dim P, state N] ----------------------


def mamba_inputs(kind, S, P=6, N=4, H=2, G=1, B=2, seed=0):
    """Global inputs of Mamba2's scan: "exact" (A = 0, no decay, dt = 1, small integers: every
    state and output an integer) or "random" (decays exp(A dt) in (0, 1), a state lasting about a
    hundred tokens)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "exact":
        ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).float()  # noqa: E731
        return {
            "hidden_states": ints(B, S, H, P),
            "dt": torch.ones(B, S, H),
            "A": torch.zeros(H),
            "B": ints(B, S, G, N),
            "C": ints(B, S, G, N),
            "D": ints(H),
        }
    return {
        "hidden_states": torch.randn(B, S, H, P, generator=gen),
        "dt": torch.rand(B, S, H, generator=gen) / 8,
        "A": -torch.rand(H, generator=gen),
        "B": torch.randn(B, S, G, N, generator=gen),
        "C": torch.randn(B, S, G, N, generator=gen),
        "D": torch.randn(H, generator=gen),
    }


def run_mamba(pool, data, n, layout, seed=3):
    shape = data["hidden_states"].shape
    cotangent = torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()
    ref = recurrent_cases.mamba_one_process(data, cotangent)
    results = pool.run(("first", n), recurrent_cases.mamba_state, data, cotangent, layout)[0]
    L = shape[1] // n
    return ref, [(expected.local_tokens(n, L, r, layout), res) for r, res in enumerate(results)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 4])
def test_mamba2_integer_states_equal_one_process_to_the_bit(pool, n, layout):
    """No decay, dt = 1: the state is a running sum of x_t B_t^T, every value an integer."""
    data = mamba_inputs("exact", S=320 if n == 4 else 160)  # L = 80
    (ref_out, ref_grads), ranks = run_mamba(pool, data, n, layout)
    assert ref_out.abs().max() > 8  # states carry values across ranks
    for key in ("A", "D"):  # the layer's own: each rank's share adds up to one process's
        assert torch.equal(sum(res[1][key] for _, res in ranks), ref_grads[key]), key
    for rows, (out, grads) in ranks:
        assert torch.equal(out, ref_out[:, rows])
        for key in recurrent_cases.MAMBA_NAMES:
            assert torch.equal(grads[key], ref_grads[key][:, rows]), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mamba2_random_states_equal_one_process(pool, layout):
    """Each output, and each gradient of x, B and C, is a sum of products that both sides round
    in other orders, at most d = S + N + 2n roundings deep (S tokens, N state entries, the fold's
    n * k maps); each is within gamma_d of the same computation on |x|, |B|, |C|, |D| and
    |cotangent| (positive decays), entry by entry, so the two differ by at most twice that. The
    gradients of dt, A and D mix signs through the decay's derivative: within twice gamma_d * S
    of their largest entry (A's and D's summed over the ranks)."""
    S, n = 192, 4
    data = mamba_inputs("random", S=S)
    (ref_out, ref_grads), ranks = run_mamba(pool, data, n, layout)
    shape = data["hidden_states"].shape
    cotangent = torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(3)).float()
    absolute = {key: value.abs() if key != "A" else value for key, value in data.items()}
    abs_out, abs_grads = recurrent_cases.mamba_one_process(absolute, cotangent.abs())
    d, u = S + data["B"].shape[-1] + 2 * n, bounds.u("float32")
    gamma = 2 * d * u / (1 - d * u)
    for key in ("A", "D"):
        summed = sum(res[1][key] for _, res in ranks)
        bounds.check((summed - ref_grads[key]).abs().max(), gamma * S * ref_grads[key].abs().max(), key)

    def ratio(difference, bound):  # the worst entry's difference over its bound (0 where both are)
        return torch.where(difference == 0, 0.0, difference.abs() / bound).max()

    for rows, (out, grads) in ranks:
        bounds.check(ratio(out - ref_out[:, rows], gamma * abs_out[:, rows]), 1.0, "outputs")
        for key in ("hidden_states", "B", "C"):
            worst = ratio(grads[key] - ref_grads[key][:, rows], gamma * abs_grads[key][:, rows])
            bounds.check(worst, 1.0, f"grad of {key}")
        bound = gamma * S * ref_grads["dt"].abs().max()
        bounds.check((grads["dt"] - ref_grads["dt"][:, rows]).abs().max(), bound, "grad of dt")


# --- Mamba: a decay per channel and state entry, the state [channels D, state N] ---------------


def selective_inputs(kind, S, D=6, N=4, B=2, seed=0):
    """Global inputs of Mamba's selective scan: "exact" (A = 0, no decay, dt = 1 with no softplus,
    small integers, no gate: every state, output and gradient an integer) or "random" (a gate;
    softplus(dt + bias) about 0.7, decays exp(A dt) with A in (-1/8, 0): a state lasting about ten
    to a hundred tokens)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "exact":
        ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).float()  # noqa: E731
        data = {"u": ints(B, D, S), "dt": torch.ones(B, D, S), "B": ints(B, N, S), "C": ints(B, N, S)}
        return data | {"A": torch.zeros(D, N), "D": ints(D), "delta_bias": torch.zeros(D), "z": None}
    return {
        "u": torch.randn(B, D, S, generator=gen),
        "dt": torch.randn(B, D, S, generator=gen) / 4,
        "B": torch.randn(B, N, S, generator=gen),
        "C": torch.randn(B, N, S, generator=gen),
        "A": -torch.rand(D, N, generator=gen) / 8,
        "D": torch.randn(D, generator=gen),
        "delta_bias": torch.randn(D, generator=gen) / 4,
    } | {"z": torch.randn(B, D, S, generator=gen)}


def run_selective(pool, data, n, layout, softplus):
    cotangent = torch.randint(-2, 3, data["u"].shape, generator=torch.Generator().manual_seed(3)).float()
    ref = recurrent_cases.selective_one_process(data, cotangent, softplus)
    results = pool.run(("first", n), recurrent_cases.selective_state, data, cotangent, layout, softplus)[0]
    L = data["u"].shape[-1] // n
    return (
        data,
        cotangent,
        ref,
        [(expected.local_tokens(n, L, r, layout), res) for r, res in enumerate(results)],
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 4])
def test_selective_scan_integer_states_equal_one_process_to_the_bit(pool, n, layout):
    """No decay, dt = 1, no gate: the state is a running sum of u_t B_t, every value an integer."""
    data, _, (ref_out, ref_grads), ranks = run_selective(
        pool, selective_inputs("exact", 96), n, layout, False
    )
    assert ref_out.abs().max() > 8  # states carry values across ranks
    for key in recurrent_cases.SELECTIVE_LAYER:  # each rank's share adds up to one process's
        assert torch.equal(sum(res[1][key] for _, res in ranks), ref_grads[key]), key
    for rows, (out, grads) in ranks:
        assert torch.equal(out, ref_out[..., rows])
        for key in ("u", "dt", "B", "C"):
            assert torch.equal(grads[key], ref_grads[key][..., rows]), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selective_scan_random_states_equal_one_process(pool, layout):
    """As Mamba2's: each output before the gate, and each gradient of u, B and C, is a sum of
    products at most d = S + N + 2n roundings deep, within gamma_d of the same computation on
    absolute values (A, dt and the decays as they are); times the gate's |silu(z)|. The gradients
    of dt, z and the layer's own parameters mix signs: within twice gamma_d * S of their largest
    entry."""
    S, n = 96, 4
    data, cotangent, (ref_out, ref_grads), ranks = run_selective(
        pool, selective_inputs("random", S), n, layout, True
    )
    kept = ("A", "dt", "delta_bias")  # the decays stay as they are
    absolute = {key: value if key in kept else value.abs() for key, value in data.items() if key != "z"}
    gate = torch.nn.functional.silu(data["z"]).abs()
    abs_out, abs_grads = recurrent_cases.selective_one_process(
        absolute | {"z": None}, cotangent.abs() * gate, True
    )
    d, u = S + data["B"].shape[1] + 2 * n, bounds.u("float32")
    gamma = 2 * d * u / (1 - d * u)

    def ratio(difference, bound):  # the worst entry's difference over its bound (0 where both are)
        return torch.where(difference == 0, 0.0, difference.abs() / bound).max()

    for key in recurrent_cases.SELECTIVE_LAYER:
        summed = sum(res[1][key] for _, res in ranks)
        bounds.check((summed - ref_grads[key]).abs().max(), gamma * S * ref_grads[key].abs().max(), key)
    for rows, (out, grads) in ranks:
        bounds.check(ratio(out - ref_out[..., rows], gamma * (abs_out * gate)[..., rows]), 1.0, "outputs")
        for key in ("u", "B", "C"):
            worst = ratio(grads[key] - ref_grads[key][..., rows], gamma * abs_grads[key][..., rows])
            bounds.check(worst, 1.0, f"grad of {key}")
        for key in ("dt", "z"):
            bound = gamma * S * ref_grads[key].abs().max()
            bounds.check((grads[key] - ref_grads[key][..., rows]).abs().max(), bound, f"grad of {key}")


# --- packed documents: the pieces a chunk's recurrence runs from zero -------------------------

# per row, document lengths over S = 320: starts at 100, 160 (a shard edge for n = 2 and 4, a chunk
# edge under head_tail), 161 (a one-token document), and 30 (a document over every later shard)
PACKED = ((100, 60, 1, 159), (30, 290))


def document_ids():
    """int64 [B, S]: each token's document, runs of equal ids (as transformers numbers them)."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in PACKED])


def check_packed(ref, plain, results, keys, n, layout):
    """Each rank's outputs and gradients equal each document alone's (ref) to the bit; the same
    rows unpacked (plain) differ by 1 or more: the documents matter."""
    (ref_out, ref_grads), plain_out = ref, plain[0]
    assert (plain_out - ref_out).abs().max() >= 1
    for r, (out, grads) in enumerate(results):
        rows = expected.local_tokens(n, ref_out.shape[1] // n, r, layout)
        assert torch.equal(out, ref_out[:, rows])
        for key in keys:
            assert torch.equal(grads[key], ref_grads[key][:, rows]), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 4])
def test_packed_documents_equal_each_document_alone_to_the_bit(pool, n, layout):
    """Gated DeltaNet's kernel (ChunkState) on packed rows, given the forward's documents as
    torch_impl.hf's pre-hook gives them: each document's state from zero, equal to the kernel on
    each document alone, outputs and every gradient, to the bit (the exact data above)."""
    data, ids, cases = inputs("exact", S=320), document_ids(), recurrent_cases
    cotangent = torch.randint(-2, 3, data["value"].shape, generator=torch.Generator().manual_seed(3)).float()
    ref = cases.one_process("gdn", data, cotangent, False, ids)
    results = pool.run(("first", n), cases.chunk_state, "gdn", data, cotangent, layout, False, ids)[0]
    check_packed(ref, cases.one_process("gdn", data, cotangent, False), results, cases.NAMES, n, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 4])
def test_mamba2_packed_documents_equal_each_document_alone_to_the_bit(pool, n, layout):
    """The same for Mamba2's scan (MambaScan; no decay, so a state not reset carries every
    earlier document's sum)."""
    data, ids, cases = mamba_inputs("exact", S=320), document_ids(), recurrent_cases
    shape = data["hidden_states"].shape
    cotangent = torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(3)).float()
    ref = cases.mamba_one_process(data, cotangent, ids)
    results = pool.run(("first", n), cases.mamba_state, data, cotangent, layout, ids)[0]
    check_packed(ref, cases.mamba_one_process(data, cotangent), results, cases.MAMBA_NAMES, n, layout)


def test_a_chunk_is_cut_where_its_documents_begin():
    """Documents [0, 5), [5, 12), [12, 20) in one row, [0, 20) in another: the chunk [8, 16)
    takes the earlier chunks' state for rows 8..11 of the first row only, and runs that row in
    two pieces; a chunk that begins with a document takes no state; a chunk without a start in
    any row runs whole (None)."""
    from torch_impl.hf.documents import pieces
    from torch_impl.layout import document_starts

    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 8, [0] * 20])
    first = document_starts(ids)
    carried, runs = pieces(first, 8, 16)
    assert carried.tolist() == [[True] * 4 + [False] * 4, [True] * 8]
    assert runs == [[(0, 4), (4, 8)], [(0, 8)]]
    carried, runs = pieces(first[:1], 12, 16)
    assert carried.tolist() == [[False] * 4] and runs == [[(0, 4)]]
    assert pieces(first, 14, 20) is None and pieces(None, 0, 8) is None


def test_the_documents_starts_are_found_once_per_forward(monkeypatch):
    """Packed rows through Qwen3.5 on one rank (its two Gated DeltaNet layers keep each document
    apart, as under CP): the documents' starts are computed once, when the forward's context is
    made, and every layer reads them from it."""
    from parity_tests.hf import hf_models
    from torch_impl import hf, layout
    from torch_impl.hf import documents, recurrent

    model = hf_models.build("qwen3_5", dtype=torch.float32)
    assert sum(recurrent.kernel_of(m) is not None for m in model.modules()) == 2
    hf.parallelize(model, None)
    calls, starts = [], layout.document_starts

    def counted(ids):
        calls.append(tuple(ids.shape))
        return starts(ids)

    monkeypatch.setattr(layout, "document_starts", counted)
    monkeypatch.setattr(documents, "document_starts", counted)
    batch = hf_models.make_packed_batch()
    model(**batch, use_cache=False).loss.backward()  # (a cache would make it an unsharded call)
    assert calls == [tuple(batch["input_ids"].shape)]
