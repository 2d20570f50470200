"""torch_impl on gloo ranks against the brute-force statements in `expected`, exactly.

Global sequences of n * 3 tokens: rank r of a CP group holds tokens [3r, 3r + 3). Data is
integer-valued (token-stamped inputs, small-integer cotangents), so every output and gradient is
exact in every float dtype and a token or gradient sent to the wrong place cannot pass. Every rank's
results are checked, for every group of a grouping (groups whose ranks are not the global ranks too).
"""

import importlib.metadata
import inspect
import math
import pathlib
import re

import numpy as np
import pytest
import torch

from parity_tests.harness import expected
from parity_tests.harness.workers import group_ranks
from parity_tests.transport import torch_cases
import torch_impl

L = 3
FLOATS = ["float32", "float64", "bfloat16", "float16"]
GROUPINGS = [("block", 1), ("block", 2), ("block", 3), ("block", 4), ("strided4", 2)]
SHAPES = [(1, ()), (2, (2,))]  # (batch, trailing dims)


def group_size(grouping):
    return len(group_ranks(grouping)[0])


def as_numpy(t):
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


# --- the plan ---------------------------------------------------------------------------------


def brute_force_routes(n, local_len, halo_size):
    """{(dst, halo position): (src, src local token)}, one token at a time, from the definition."""
    routes = {}
    for dst in range(n):
        h = min(dst * local_len, halo_size)
        for i, token in enumerate(range(dst * local_len - h, dst * local_len)):
            routes[(dst, i)] = (token // local_len, token % local_len)
    return routes


@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize("local_len", range(0, 5))
def test_halo_plan_matches_brute_force(n, local_len):
    for halo_size in range(n * local_len + 4):
        plan = torch_impl.halo_plan(n, local_len, halo_size)
        routes = {}
        for t in plan:
            assert t.length > 0 and t.src < t.dst, t
            for k in range(t.length):
                key = (t.dst, t.dst_start + k)
                assert key not in routes, f"halo position {key} filled twice"
                routes[key] = (t.src, local_len - t.length + k)  # a tail of src's shard
        assert routes == brute_force_routes(n, local_len, halo_size)
        assert sum(t.length for t in plan) == sum(min(r * local_len, halo_size) for r in range(n))
        for dst in range(n):  # at most ceil(halo_size / L) peers, the nearest ones
            peers = sorted(t.src for t in plan if t.dst == dst)
            assert len(peers) <= (math.ceil(halo_size / local_len) if local_len else 0)
            assert peers == list(range(dst - len(peers), dst))


def test_halo_plan_example():
    """n=3, L=2, halo_size=3: rank 1 gets tokens 0-1 from rank 0; rank 2 gets 1 from 0 and 2-3 from 1."""
    assert torch_impl.halo_plan(3, 2, 3) == (
        torch_impl.Transfer(src=0, dst=1, dst_start=0, length=2, src_start=0),
        torch_impl.Transfer(src=1, dst=2, dst_start=1, length=2, src_start=0),
        torch_impl.Transfer(src=0, dst=2, dst_start=0, length=1, src_start=1),
    )


# --- exact multi-rank forward and backward ----------------------------------------------------


def make_config(n, batch, trailing, out_lens, dtype, seed, **extra):
    """A global stamped input and per-rank cotangents of lengths out_lens[r]."""
    rng = np.random.default_rng(seed)
    return {
        "x": expected.stamped((batch, n * L, *trailing), np.float64),
        "cotangents": [
            expected.small_ints(rng, (batch, out_len, *trailing), np.float64) for out_len in out_lens
        ],
        "dtype": dtype,
        **extra,
    }


def check_rank_results(results, want_y, want_grad, dtype):
    """results[g][r]: every rank of every group has the wanted output and gradient, dtype and no mutation."""
    for group_results in results:
        for r, res in enumerate(group_results):
            assert res["y"].dtype == torch_cases.DTYPES[dtype] and res["grad"].dtype == res["y"].dtype
            np.testing.assert_array_equal(as_numpy(res["y"]), want_y[r], err_msg=f"output, rank {r}")
            np.testing.assert_array_equal(
                as_numpy(res["grad"]), want_grad[:, r * L : (r + 1) * L], err_msg=f"grad, rank {r}"
            )
            assert not res["mutated"] and not res["cotangent_mutated"]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
def test_gather_halo_exact(pool, grouping, dtype):
    n = group_size(grouping)
    configs = []
    for halo_size in range(n * L + 3):
        for left_padding in (0, 2):
            for batch, trailing in SHAPES:
                configs.append(
                    make_config(
                        n,
                        batch,
                        trailing,
                        [left_padding + min(r * L, halo_size) + L for r in range(n)],
                        dtype,
                        seed=len(configs),
                        halo_size=halo_size,
                        left_padding=left_padding,
                        noncontiguous=len(configs) % 3 == 0,
                    )
                )
    results = pool.run(grouping, torch_cases.halo, configs)
    for i, c in enumerate(configs):
        want_y = expected.halo_forward(c["x"], n, c["halo_size"], c["left_padding"])
        want_grad = expected.halo_backward(
            c["cotangents"], n, L, c["halo_size"], c["left_padding"], np.float64
        )
        check_rank_results([[res[i] for res in g] for g in results], want_y, want_grad, dtype)
        if n == 1 and c["left_padding"] == 0:
            assert all(g[0][i]["y_is_x"] for g in results)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
def test_gather_sequence_exact(pool, grouping, dtype):
    n = group_size(grouping)
    configs = [
        make_config(n, batch, trailing, [n * L] * n, dtype, seed=i, noncontiguous=nc)
        for i, ((batch, trailing), nc) in enumerate([(s, nc) for s in SHAPES for nc in (False, True)])
    ]
    results = pool.run(grouping, torch_cases.sequence, configs)
    for i, c in enumerate(configs):
        want_grad = expected.sequence_backward(c["cotangents"])
        check_rank_results([[res[i] for res in g] for g in results], [c["x"]] * n, want_grad, dtype)
        assert all(res[i]["y_is_x"] == (n == 1) for g in results for res in g)


@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
def test_gather_metadata_exact(pool, grouping):
    n = group_size(grouping)
    base = expected.stamped((2, n * L, 2), np.int64)
    configs = [
        {"x": (base % 3 == 0), "dtype": "bool"},
        {"x": base, "dtype": "int64"},
        {"x": base - 70, "dtype": "int32", "noncontiguous": True},
        {"x": base, "dtype": "uint8"},
        {"x": base[:1, :, 0].astype(np.float64) / 4, "dtype": "float32"},
    ]
    results = pool.run(grouping, torch_cases.metadata, configs)
    for i, c in enumerate(configs):
        for g in results:
            for res in g:
                y = res[i]["y"]
                assert y.dtype == torch_cases.DTYPES[c["dtype"]] and not res[i]["requires_grad"]
                np.testing.assert_array_equal(as_numpy(y), c["x"].astype(as_numpy(y).dtype))
                assert res[i]["y_is_x"] == (n == 1)


# --- without CP, and bad input ----------------------------------------------------------------


def test_without_cp_the_input_itself_comes_back():
    x = torch.randn(2, 4, 3, requires_grad=True)
    assert torch_impl.gather_sequence(x, None) is x
    assert torch_impl.gather_halo(x, None, 5) is x
    m = torch.arange(8).reshape(2, 4)
    assert torch_impl.gather_metadata(m, None) is m


def test_without_cp_left_padding_prepends_zeros_with_gradient():
    x = torch.arange(1.0, 9.0, dtype=torch.bfloat16).reshape(1, 4, 2).requires_grad_()
    y = torch_impl.gather_halo(x, None, 3, left_padding=2)
    assert y.shape == (1, 6, 2) and y.dtype == torch.bfloat16
    assert torch.equal(y[:, :2], torch.zeros(1, 2, 2, dtype=torch.bfloat16)) and torch.equal(y[:, 2:], x)
    y.backward(torch.arange(12.0, dtype=torch.bfloat16).reshape(1, 6, 2))
    assert torch.equal(x.grad, torch.arange(4.0, 12.0, dtype=torch.bfloat16).reshape(1, 4, 2))


BAD_CALLS = [
    (
        ("gather_sequence", (4,), "float32", False, {}),
        r"`x` must be \[batch, local_sequence, ...\] \(ndim >= 2\), got shape \(4,\)",
    ),
    (("gather_halo", (4,), "float32", False, {"halo_size": 1}), r"ndim >= 2\), got shape \(4,\)"),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": -1}),
        "`halo_size` must be a non-negative int, got -1",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": 2.0}),
        "`halo_size` must be a non-negative int, got 2.0",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": True}),
        "`halo_size` must be a non-negative int, got True",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": (1, 2, 3)}),
        r"one per global chunk \((\d) for layout='contiguous' over \1 ranks\), got \(1, 2, 3\)",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": (0, 1, -1, 2)}),
        "`halo_size` must be a non-negative int, got -1",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": 1, "lookahead": -1}),
        "`lookahead` must be a non-negative int, got -1",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": 1, "lookahead": (1, 2, 3)}),
        r"`lookahead` must be a non-negative int or one per global chunk",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": 1, "left_padding": -2}),
        "`left_padding` must be a non-negative int, got -2",
    ),
    (
        ("gather_halo", (1, 4), "float32", False, {"halo_size": 1, "left_padding": "1"}),
        "`left_padding` must be a non-negative int, got '1'",
    ),
    (("gather_metadata", (4,), "int64", False, {}), r"ndim >= 2\), got shape \(4,\)"),
    (("gather_metadata", (1, 4), "float32", True, {}), "`x` must not require grad in gather_metadata"),
]


@pytest.mark.parametrize("call,match", BAD_CALLS)
def test_bad_arguments_raise_value_error_without_cp(call, match):
    name, shape, dtype, requires_grad, kwargs = call
    x = torch.zeros(shape, dtype=torch_cases.DTYPES[dtype]).requires_grad_(requires_grad)
    with pytest.raises(ValueError, match=match):
        getattr(torch_impl, name)(x, None, **kwargs)


def test_bad_group_raises_value_error():
    with pytest.raises(
        ValueError,
        match="`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh or None, got int",
    ):
        torch_impl.gather_sequence(torch.zeros(1, 2), 0)


@pytest.mark.parametrize("grouping", [("block", 4), ("strided4", 2)], ids=str)
def test_bad_arguments_raise_on_every_rank_before_communicating(pool, grouping):
    n = group_size(grouping)
    results = pool.run(grouping, torch_cases.bad_arguments, [call for call, _ in BAD_CALLS])
    for g in results:
        for messages, gathered in g:
            for message, (_, match) in zip(messages, BAD_CALLS, strict=True):
                assert message is not None and re.search(match, message), (message, match)
            assert gathered == [float(r + 1) for r in range(n) for _ in range(2)]


def test_both_halo_exchanges_receive_the_analytic_minimum(pool):
    """Eager p2p and the all_to_all that torch.compile traces: every rank receives, forward and
    backward, exactly its halo and the gradients of the tokens it lent (counted at the c10d calls);
    the compiled call's TCP bytes are that payload plus message headers (under 1 KiB per peer)."""
    n, L, D, sizes = 4, 6, 8, [0, 1, 5, 6, 7, 13, 18, 30]
    (results,) = pool.run(("first", n), torch_cases.halo_bytes, sizes, L, D)
    for r, rows in enumerate(results):
        for h, row in zip(sizes, rows, strict=True):
            plan = torch_impl.halo_plan(n, L, h)
            tokens = sum(t.length for t in plan if t.dst == r) + sum(t.length for t in plan if t.src == r)
            assert row["p2p"] == row["all_to_all"] == tokens * D * 4, (r, h, row)
            assert tokens * D * 4 <= row["compiled_wire"] <= tokens * D * 4 + 1024 * (n - 1), (r, h, row)


def test_public_names():
    """`__all__` lists the public API; the autograd Functions stay importable under their names.
    Every public function of torch_impl, torch_impl.attention and torch_impl.hf is annotated (each
    parameter but *args/**kwargs, and its return); the package is typed (py.typed) and versioned as
    installed."""
    assert torch_impl.__all__ == [
        "Transfer",
        "gather_halo",
        "gather_metadata",
        "gather_sequence",
        "gather_state",
        "halo_plan",
        "last_position",
        "select_position",
        "sum_sequence",
    ]
    from torch_impl import _GatherHalo, _GatherSequence, attention, hf

    assert issubclass(_GatherHalo, torch.autograd.Function) and issubclass(
        _GatherSequence, torch.autograd.Function
    )
    for package in (torch_impl, attention, hf):
        for name in package.__all__:
            value = getattr(package, name)
            assert not name.startswith("_"), name
            if inspect.isfunction(value) or hasattr(value, "_opoverload"):
                function = getattr(value, "_init_fn", value)  # a torch.library custom op: its function
                signature = inspect.signature(function)
                unannotated = [
                    p.name
                    for p in signature.parameters.values()
                    if p.annotation is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                ]
                assert not unannotated and signature.return_annotation is not signature.empty, (
                    f"{package.__name__}.{name}",
                    unannotated,
                )
    assert torch_impl.__version__ == importlib.metadata.version("cp-transport")
    assert (pathlib.Path(torch_impl.__file__).parent / "py.typed").is_file()


def test_head_tail_halos_move_only_the_windows(pool):
    """head_tail, n = 4, C = 3: every rank receives, forward and backward, exactly the tokens of its
    chunks' windows that other ranks hold and the gradients of its tokens that other ranks' windows
    held (brute force over global tokens; rank 3's own head, in its tail's window, moves nothing)."""
    n, L, D, sizes = 4, 6, 8, [0, 1, 3, 4, 7, 12, 21, 30]
    (results,) = pool.run(("first", n), torch_cases.halo_bytes, sizes, L, D, "head_tail", False)
    owner = {t: r for r in range(n) for t in expected.local_tokens(n, L, r, "head_tail")}
    for h, per_rank in zip(sizes, zip(*results, strict=True), strict=True):
        segments = [expected.halo_segments(n, L, r, h, "head_tail") for r in range(n)]
        windows = [[t for size, tokens in seg for t in list(tokens)[:size]] for seg in segments]
        for r, row in enumerate(per_rank):
            received = sum(owner[t] != r for t in windows[r])  # forward: its windows
            returned = sum(owner[t] == r for q in range(n) if q != r for t in windows[q])  # backward
            assert row["p2p"] == row["all_to_all"] == (received + returned) * D * 4, (r, h, row)
    assert any(owner[t] == 3 for t in windows[3])  # the local copy was exercised
