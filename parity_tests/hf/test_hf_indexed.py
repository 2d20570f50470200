"""torch_impl.hf on DeepSeek Sparse Attention models (DeepSeek V3.2, GLM-5): the CP ranks against
one process (parity_tests.hf.hf_reference), the bytes they receive, the indexer's query blocks."""

import pytest

from cp_support.minima import indexed_layer_bytes
from parity_tests.hf import hf_cases, hf_models
from parity_tests.hf.hf_reference import (
    assert_matches_reference,
    check_bytes,
    reference,
)

# --- DeepSeek Sparse Attention ---------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_equals_one_process_float64(pool, name, n):
    """DeepSeek V3.2 and GLM-5 (layer 1 reusing layer 0's top-k): the indexer picks 5 of up to 24
    keys, batch 2 with a right-padded row; the CP ranks' logits, loss and gradients equal one
    process's (the indexer's parameters get none in either). One group of ranks (every group of
    the grouping runs in the tests above)."""
    ref = reference(name, "float64")
    config = hf_models.build(name).config
    L, B = hf_models.SEQ_LEN // n, 2
    for group_results in pool.run(("first", n), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)
        for r, res in enumerate(group_results):  # bytes: the causal prefix, counted at the c10d calls
            wanted = {("forward", "inputs", "mask"): B * (n - 1) * L}  # the padding mask, once
            wanted[("forward", "inputs", "int64")] = check_bytes(n)
            for i, kind in enumerate(getattr(config, "indexer_types", None) or ["full"] * 2):
                per_row = indexed_layer_bytes(config, n, L, r, 8, indexer=kind == "full")
                for direction in ("forward", "backward"):
                    wanted[(direction, i, "float64")] = B * per_row[("torch_impl", direction)]
            assert {k: v for k, v in res["received"].items() if v} == {k: v for k, v in wanted.items() if v}


@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_with_left_padding(pool, name):
    """Row 1 padded on the left: every query of it follows the padding, so a query that saw (or
    picked) a padding key would differ from one process, which sees none. (Right padding only
    ever follows a row's queries and cannot tell.)"""
    ref = reference(name, "float64", left=True)
    for group_results in pool.run(("first", 2), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)


@pytest.mark.parametrize("mode", ["train_ac", "train_ac_saved"])
@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_under_activation_checkpointing(pool, name, mode):
    """transformers' checkpointed decoder layers are called without a cache: the latents reach the
    attention as its key and value (torch_impl.hf.indexed.AbsorbedMLA), so recomputation needs
    nothing else; with transformers' checkpointing and with hf.checkpoint_kwargs()."""
    ref = reference(name, "float64")
    for group_results in pool.run(("first", 2), hf_cases.cp_step, name, "float64", ref[0], ref[1], mode):
        assert_matches_reference(group_results, ref)


def test_the_indexer_scores_one_query_block_at_a_time(pool):
    """With blocks of 2 queries, the indexer's float32 scores hold 2 x 16 heads x (r+1)*L keys per
    row (rank 1 of 2: 24 keys), not L = 12 queries' worth."""
    state, batch, *_ = reference("deepseek_v32", "float64")
    (results,) = pool.run(("first", 2), hf_cases.indexer_scores, "deepseek_v32", state, batch, 2)
    assert results == [2 * 2 * 16 * 12, 2 * 2 * 16 * 24]


@pytest.mark.parametrize("layout,n", [("contiguous", 2), ("head_tail", 4)])
def test_the_indexer_in_several_query_blocks_equals_one_process(pool, layout, n):
    """Blocks of 5 query rows (12 or 6 local queries: whole blocks and a partial one), the left-
    padded row: each block's mask, top-k and the attention over it are one process's."""
    ref = reference("deepseek_v32", "float64", left=True)
    args = ("deepseek_v32", "float64", ref.state, ref.batch, "eval", layout, 5)
    for group_results in pool.run(("first", n), hf_cases.cp_step, *args):
        assert_matches_reference(group_results, ref, layout=layout)
