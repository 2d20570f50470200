"""What each gloo rank runs for the reliability tests: validation, compile, long runs, faults."""

import os
import re
import time

import torch
import torch.distributed as dist

import torch_impl
from torch_impl import validation


def _rank_input(r, L=4, trailing=(3,), dtype=torch.float32):
    return (torch.arange(L, dtype=dtype)[None, :, None] + r * L).expand(2, L, *trailing).clone()


# scenario -> (function, per-rank inputs and arguments); rank 2 (or 1) is the culprit
MISMATCHES = {
    "local_length": lambda r: ("gather_sequence", _rank_input(r, L=5 if r == 2 else 4), {}),
    "dtype": lambda r: (
        "gather_sequence",
        _rank_input(r, dtype=torch.float64 if r == 2 else torch.float32),
        {},
    ),
    "trailing_dims": lambda r: (
        "gather_halo",
        _rank_input(r, trailing=(2,) if r == 2 else (3,)),
        {"halo_size": 3},
    ),
    "halo_size": lambda r: ("gather_halo", _rank_input(r), {"halo_size": 5 if r == 2 else 3}),
    # one halo per chunk, as many on every rank, one value differs (without the check: gloo aborts
    # on a message of the wrong size)
    "per_chunk_halo_sizes": lambda r: (
        "gather_halo",
        _rank_input(r),
        {"halo_size": (0, 3, 3, 2 if r == 2 else 3)},
    ),
    "function": lambda r: ("gather_metadata" if r == 2 else "gather_sequence", _rank_input(r), {}),
    "bad_local_argument": lambda r: ("gather_halo", _rank_input(r), {"halo_size": -1 if r == 1 else 3}),
}


def mismatch(group, scenario, via_env):
    """Every rank calls with its scenario's arguments; returns (ValueError message or None, seconds)."""
    function, x, kwargs = MISMATCHES[scenario](dist.get_rank(group))
    if via_env:
        os.environ[validation.ENV_VAR] = "1"
    else:
        kwargs["validate"] = True
    start = time.monotonic()
    try:
        getattr(torch_impl, function)(x, group, **kwargs)
        message = None
    except ValueError as e:
        message = str(e)
    finally:
        os.environ.pop(validation.ENV_VAR, None)
    return message, time.monotonic() - start


def left_padding_may_differ(group):
    """Per-rank left_padding (the demo's alignment padding) passes validation."""
    r = dist.get_rank(group)
    y = torch_impl.gather_halo(_rank_input(r), group, 3, left_padding=3 - min(r * 4, 3), validate=True)
    return tuple(y.shape)


def compiled_matches_eager(group, backend, functions):
    """Each function eager vs torch.compile(fullgraph=True): outputs and gradients, to the bit."""
    import torch._dynamo

    torch._dynamo.reset()
    r = dist.get_rank(group)
    calls = {
        "gather_sequence": lambda x: torch_impl.gather_sequence(x, group) * 2,
        "gather_metadata": lambda x: torch_impl.gather_metadata(x.detach(), group).cumsum(1),
        "gather_metadata_bool": lambda x: torch.where(torch_impl.gather_metadata(x > 5, group), x.sum(), 0.0),
        "gather_halo": lambda x: torch_impl.gather_halo(x, group, 5, left_padding=1) * 2,
    }
    out = {}
    for name in functions:
        fn = calls[name]
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        for batch in (1, 2):
            results = []
            for f in (fn, compiled):
                x = _rank_input(r)[:batch].clone().requires_grad_(True)
                y = f(x)
                if y.requires_grad:
                    y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) % 7)
                results.append((y.detach(), x.grad))
            (y0, g0), (y1, g1) = results
            out[(name, batch)] = torch.equal(y0, y1) and (g0 is None and g1 is None or torch.equal(g0, g1))
    return out


def _rss_mib():
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def long_run(group, calls, warmup):
    """`calls` forward+backward calls of each function; returns per function the resident-set
    growth (MiB) after warm-up and whether every call gave the first call's output and gradient."""
    r = dist.get_rank(group)
    fns = {
        "gather_sequence": lambda x: torch_impl.gather_sequence(x, group),
        "gather_halo": lambda x: torch_impl.gather_halo(x, group, 6, left_padding=2),
        "gather_metadata": lambda x: torch_impl.gather_metadata(x.detach() > 3, group),
    }
    report = {}
    for name, fn in fns.items():
        first, same, rss = None, True, None
        for i in range(warmup + calls):
            if i == warmup:
                rss = _rss_mib()
            x = _rank_input(r, L=4, trailing=(16,)).requires_grad_(True)
            y = fn(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y) * (r + 1))
            result = (y.detach().clone(), None if x.grad is None else x.grad.clone())
            if first is None:
                first = result
            same &= torch.equal(result[0], first[0]) and (
                result[1] is None or torch.equal(result[1], first[1])
            )
        report[name] = {"rss_start_mib": rss, "rss_growth_mib": _rss_mib() - rss, "identical": same}
    return report


def mesh_and_alternating_groups(rank, world):
    """On a DP x CP (2 x 2) DeviceMesh: a 2-D mesh is refused; the CP sub-mesh (ranks {0,1}, {2,3})
    and the DP one ({0,2}, {1,3}, strided) used alternately, three rounds, each gathering."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    try:
        torch_impl.gather_sequence(_rank_input(rank), mesh)
        refused = None
    except ValueError as e:
        refused = str(e)
    rounds = []
    for _ in range(3):
        for name in ("cp", "dp"):
            sub = mesh[name]
            r = dist.get_rank(sub.get_group())
            x = _rank_input(r).requires_grad_(True)
            y = torch_impl.gather_sequence(x, sub, validate=True)
            h = torch_impl.gather_halo(x, sub, 5)
            (y.sum() + 10 * h.sum()).backward()
            rounds.append(
                (name, r, dist.get_process_group_ranks(sub.get_group()), y.detach(), h.detach(), x.grad)
            )
    return refused, rounds


def survive_dead_peer(rank, store_path, function, results):
    """Rank 0 dies once both have joined (rank 1 says so through the store: rank 0's join can return
    while rank 1's is still connecting, which then fails instead of the call); rank 1 calls
    `function` and reports what it saw, and when."""
    from datetime import timedelta

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    if rank == 0:
        store.wait(["joined"])
        os._exit(1)
    store.set("joined", "1")
    time.sleep(0.5)  # (rank 0 gone)
    group, x = dist.group.WORLD, _rank_input(rank)
    start = time.monotonic()
    try:
        if function == "gather_halo":
            torch_impl.gather_halo(x, group, 3)
        else:
            getattr(torch_impl, function)(x, group)
        outcome = "returned"
    except Exception as e:  # what a survivor sees: any exception type, reported as text
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    results.put((outcome, time.monotonic() - start))
