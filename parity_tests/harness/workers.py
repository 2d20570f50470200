"""A pool of gloo worker processes, started once and fed many cases (cf. PyTorch's MultiProcContinuousTest).

The pool is one world of WORLD ranks; a case names a *grouping*, a partition of some of those ranks
into CP groups, and runs on every group of it at once, so each case also exercises groups whose
ranks are not the global ones. (A grouping says which processes form a CP group; a sequence
*layout*, torch_impl.layout, which tokens each rank of a group holds.) Rendezvous is a FileStore
on a temp file (no port). Every case has a timeout; a rank's exception comes back with its
traceback; a failed or hung case kills the pool, which the next case starts afresh.
"""

from datetime import timedelta
import importlib
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback

from cp_support.launch import collect, failure_message

WORLD = 8
CASE_TIMEOUT_S = 60
GLOO_TIMEOUT_S = 45  # a collective stuck on a dead peer errors out before the case times out
STARTUP_TIMEOUT_S = 120  # spawning WORLD processes that import torch, on 2 cores


def threads_per_rank():
    """OMP_NUM_THREADS when set, else the cores shared among the WORLD ranks (at least one): 8 ranks
    of torch's default threads on a 2-core machine would oversubscribe it 8x."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // WORLD))


def group_ranks(grouping):
    """The CP groups (lists of global ranks) of a grouping, e.g. ("block", 3) -> [[0, 1, 2], [3, 4, 5]].

    ("block", n): consecutive ranks; ("strided", n): ranks r, r + k, r + 2k, ... with k = WORLD // n;
    ("strided4", 2): the groups {0, 2} and {1, 3} of a world of 4 (ranks 4..7 idle); ("first", n):
    ranks 0..n-1 alone (for cases too costly to run on every group, like compiling).
    """
    kind, n = grouping
    if kind == "first":
        return [list(range(n))]
    if kind == "block":
        return [list(range(g * n, (g + 1) * n)) for g in range(WORLD // n)]
    if kind == "strided":
        k = WORLD // n
        return [list(range(first, WORLD, k)) for first in range(k)]
    if kind == "strided4":
        return [[0, 2], [1, 3]]
    raise ValueError(f"unknown grouping {grouping!r}")


GROUPINGS = [("block", n) for n in (1, 2, 3, 4, 8)] + [
    ("strided", 2),
    ("strided", 4),
    ("strided4", 2),
    ("first", 2),
    ("first", 4),
    *(("first", n) for n in (5, 6, 7)),  # the world sizes that do not tile the pool (gather_state)
]


def _worker(rank, store_path, tasks, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank())
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=GLOO_TIMEOUT_S)
    )
    groups = {}
    for grouping in GROUPINGS:  # every rank creates every group, in the same order
        for index, ranks in enumerate(group_ranks(grouping)):
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[grouping] = (index, group)
    while True:
        task = tasks.get()
        if task is None:  # the session's end: exit at once (gloo's teardown waits on every peer)
            os._exit(0)
        case_id, grouping, module, name, args = task
        try:
            member = groups.get(grouping)
            if member is None:
                payload = None
            else:
                fn = getattr(importlib.import_module(module), name)
                payload = (member[0], dist.get_rank(member[1]), fn(member[1], *args))
            results.put((case_id, rank, True, pickle.dumps(payload)))
        except BaseException:
            results.put((case_id, rank, False, traceback.format_exc()))


class CaseFailed(RuntimeError):
    pass


class WorkerPool:
    def __init__(self):
        self._procs = None
        self._case_id = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="cp_pool_")
        self._tasks = [ctx.Queue() for _ in range(WORLD)]
        self._results = ctx.Queue()
        store_path = os.path.join(self._dir, "store")
        self._procs = [
            ctx.Process(target=_worker, args=(r, store_path, self._tasks[r], self._results), daemon=True)
            for r in range(WORLD)
        ]
        for p in self._procs:
            p.start()

    def close(self, kill=False):
        if self._procs is None:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._procs = None

    def run(self, grouping, fn, *args, timeout=CASE_TIMEOUT_S):
        """Run fn(group, *args) on every rank of every group of `grouping`.

        Returns results[g][group_rank], g indexing group_ranks(grouping). Raises CaseFailed with the
        failing ranks' tracebacks, or when some rank does not answer within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        if self._procs is None:
            self._start()
            deadline += STARTUP_TIMEOUT_S
        self._case_id += 1
        for q in self._tasks:
            q.put((self._case_id, grouping, fn.__module__, fn.__name__, args))

        def unpack(item):
            case_id, rank, ok, payload = item
            assert case_id == self._case_id, (case_id, self._case_id)
            return rank, ok, payload

        answers, failures, missing = collect(self._results, WORLD, deadline, unpack)
        if failures or missing:
            self.close(kill=True)
            what = f"{fn.__name__}{args!r:.200} on {grouping}"
            raise CaseFailed(failure_message(what, failures, missing, timeout))
        results = [[None] * len(ranks) for ranks in group_ranks(grouping)]
        for payload in answers.values():
            member = pickle.loads(payload)
            if member is not None:
                g, group_rank, value = member
                results[g][group_rank] = value
        return results
