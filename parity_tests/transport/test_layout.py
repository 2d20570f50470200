"""torch_impl.layout against brute force: which global rows a rank holds, what a layer of reach h
gives each of its chunks (ShardPlan), and how far back packed documents reach (document_reach)."""

import os

import pytest
import torch

from parity_tests.harness import expected
from torch_impl.layout import ShardPlan, document_reach


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_shard_plan_against_brute_force(layout):
    """ShardPlan (which rows a rank holds, what a layer of reach h gives each of its chunks) for
    n = 1..8, chunks of 1 and 3 tokens, every reach from 0 to past the prefix and the whole prefix
    (None), left padding 0 and 2: stated token by token over the global sequence."""
    for n in range(1, 9):
        for C in (1, 3):
            L = C if layout == "contiguous" else 2 * C
            for r in range(n):
                plan = ShardPlan.of(layout, n, r, L)
                rows = expected.local_tokens(n, L, r, layout)
                assert plan.rows().tolist() == rows and plan.end == max(rows) + 1
                per_chunk = tuple((7 * c) % (n * L + 2) for c in range(plan.num_chunks))  # one per chunk
                for reach in [*range(n * L + 2), None, per_chunk]:
                    for lp in (0, 2):
                        row = 0
                        windows = plan.windows(reach, lp)
                        assert len(windows) == len(rows) // C
                        for k, w in enumerate(windows):
                            own = rows[k * C : (k + 1) * C]
                            assert own == list(range(w.start, w.end)) == rows[w.queries]
                            h = reach[w.chunk] if isinstance(reach, tuple) else reach
                            window = [t for t in range(w.start) if h is None or w.start - t <= h]
                            assert list(range(w.first_key, w.start)) == window and w.halo == len(window)
                            assert list(range(n * L))[w.keys] == window + own
                            assert w.segment == slice(row, row + lp + len(window) + C), (n, r, reach, lp)
                            assert w.own == slice(w.segment.stop - C, w.segment.stop)
                            assert w.window_rows == slice(row + lp, row + lp + len(window))
                            row = w.segment.stop
    with pytest.raises(ValueError, match="`layout` must be one of"):
        ShardPlan.of("zigzag", 2, 0, 4)


def test_document_reach_against_brute_force():
    """document_reach: per chunk, how far back its first token's document began (the most over the
    rows), for documents starting on a chunk edge, spanning three chunks, one token long."""
    documents = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2], [0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5]])
    for C in (1, 2, 3, 4, 6, 12):
        want = []
        for start in range(0, 12, C):
            firsts = [min(t for t in range(12) if documents[b, t] == documents[b, start]) for b in range(2)]
            want.append(max(start - f for f in firsts))
        assert document_reach(documents, C) == tuple(want), C
    assert document_reach(documents, 3) == (0, 3, 6, 1)  # row 0's first document spans chunks 0-2
    with pytest.raises(ValueError, match="non-decreasing"):
        document_reach(torch.tensor([[0, 0, 1, 0]]), 2)


def test_every_mutation_still_applies():
    """Each of `make mutants`' plausible bugs changes text that occurs exactly once in its file, so
    that the code moving on cannot silently leave a mutation applying nowhere."""
    from tools.mutations import MUTATIONS, ROOT

    for m in MUTATIONS:
        with open(os.path.join(ROOT, m.path)) as f:
            assert f.read().count(m.old) == 1, (m.name, m.path)
