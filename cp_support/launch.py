"""Run a function on `world_size` gloo processes, once, with a time limit (the demo, benchmarks, tests).

Rendezvous is a FileStore on a temp file, never a fixed port. A rank that raises sends back its
traceback; a rank that hangs (its peers failed, or a collective never completes) is killed when the
time limit passes, and every other rank with it.
"""

from datetime import timedelta
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback

# for measuring ranks: glibc serves and returns large blocks by mmap, so freed tensors leave the
# resident set at once; PyTorch's CPU allocator asks for transparent huge pages; one thread a rank
RANK_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "OMP_NUM_THREADS": "1",
    "THP_MEM_ALLOC_ENABLE": "1",
}
FAILURE_GRACE_S = 5  # once a rank failed, how long its peers may still answer


def _rank_main(rank, world_size, store_path, gloo_timeout_s, fn, args, results):
    try:
        import torch.distributed as dist

        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=gloo_timeout_s)
        )
        try:
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))  # by value
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, *args, timeout_s=300, env=None):
    """fn(rank, world_size, *args) on each rank of a fresh gloo world; returns the per-rank results.

    `fn` must be importable (a module-level function); `env` is set in the ranks' environment.
    Raises RuntimeError with the failing ranks' tracebacks, or naming the ranks that did not finish.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # spawned children inherit the environment at start
    with tempfile.TemporaryDirectory(prefix="cp_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, store_path, max(30, timeout_s - 10), fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        answers, failures, missing = collect(results, world_size, time.monotonic() + timeout_s)
        for p in procs:
            p.join(timeout=5 if not failures and len(answers) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    if failures or missing:
        raise RuntimeError(
            failure_message(f"{fn.__name__} on {world_size} ranks failed", failures, missing, timeout_s)
        )
    return [pickle.loads(answers[r]) for r in range(world_size)]


def collect(results, world_size, deadline, unpack=tuple):
    """Answers from `world_size` ranks on the queue `results`, each unpack(item) = (rank, ok,
    payload), until all answered or the monotonic `deadline` passed; once a rank has failed, its
    peers get FAILURE_GRACE_S more (they may be waiting on it in a collective). Returns (answers,
    failures: tracebacks, missing: the ranks that did not answer), answers and failures by rank."""
    answers, failures = {}, {}
    while len(answers) + len(failures) < world_size:
        try:
            item = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        rank, ok, payload = unpack(item)
        (answers if ok else failures)[rank] = payload
        if failures:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return answers, failures, sorted(set(range(world_size)) - set(answers) - set(failures))


def failure_message(what, failures, missing, limit_s):
    """`what`, then the ranks that did not answer within limit_s, then each failed rank's traceback."""
    hung = f"ranks {missing} did not answer within {limit_s}s (hung?)" if missing else ""
    return f"{what}: {hung}" + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
