"""The model sweep's quick subset, and what keeps the support matrix honest.

`make models` runs every causal-LM family of the pinned transformers (tools.model_sweep); here
a dozen of them, every layer kind the adapter has once, run the same cases on 2 ranks (rank 0: tokens
[0, 16), rank 1: [16, 32); head_tail: chunks 0 and 3, 1 and 2 of 8 tokens): padded rows (right, and
left with the pad token at the padding), both layouts, and packed rows. Each family must come out
as docs/models.md says, and that matrix must be current. Five image-text-to-text classes run the
same on text-only batches, two with the token types a processor returns for text.
"""

import re

import pytest

from parity_tests.hf import zoo, zoo_cases
from tools import model_sweep

QUICK = {  # family: (what it exercises, its verdict)
    "llama": ("full attention", "exact"),
    "mistral": ("sliding windows", "exact"),
    "gemma3_text": ("sliding and full layers", "exact"),
    "gemma2": ("soft-capped attention", "exact"),
    "gpt_oss": ("attention sinks", "exact"),
    "lfm2": ("short convolutions", "exact"),
    "lfm3": ("short convolutions with sliding and full layers", "exact"),
    "llama4_text": ("chunked attention, NoPE layers scaling queries by their row", "exact"),
    "deepseek_v3": ("MLA: value heads narrower than the query and key heads", "exact"),
    "deepseek_v32": ("DeepSeek Sparse Attention", "exact"),
    "hy_v4": ("DeepSeek Sparse Attention with sinks", "exact"),
    "qwen4_exp_text": ("Qwen4's QSA: top-k blocks of pooled keys, beside Gated DeltaNet", "exact"),
    "dots3_note_text": ("DeepSeek Sparse Attention beside sliding MLA layers", "exact"),
    "deepseek_v4": ("compressed entries (CSA's indexer, HCA) beside a sliding window, with sinks", "exact"),
    "minimax_m3_vl_text": ("MiniMax-M3's block-sparse layers: top-k blocks per KV head", "exact"),
    "inkling_text": ("relative logits by distance; queries log-scaled by their row; short convs", "exact"),
    "inkling2_text": ("relative logits, per-query sinks, keys and values convolved per token", "exact"),
    "opt": ("a causal LM calling its decoder directly; positions counting real tokens", "exact"),
    "roberta": ("positions from the padding index and the pad tokens", "exact"),
    "gemma3": ("a multimodal model given text", "exact"),
    "qwen2_moe": ("a sliding mask made for the mapping (window 0) that no layer takes", "exact"),
    "doge": ("an attention that edits its mask", "refused"),
    "qwen3_next": ("Gated DeltaNet: the recurrent state from the earlier ranks, a conv halo", "exact"),
    "olmo_hybrid": ("Gated DeltaNet with negative eigenvalues (beta up to 2)", "exact"),
    "minimax": ("MiniMax's lightning attention (a decay per head) in blocks ending mid-chunk", "exact"),
    "nemotron_h": ("Mamba2 layers (a decay per head), attention, MLP and MoE layers", "exact"),
    "falcon_h1": ("attention and Mamba2 in parallel in every layer", "exact"),
    "jamba": ("Mamba (a per-channel selective scan), attention and MoE", "exact"),
    "recurrent_gemma": ("RG-LRU (a per-channel gated scan) behind an nn.Conv1d, local attention", "exact"),
    "zamba": ("Mamba scans called once per Mamba head", "exact"),
    "xlstm": ("xLSTM's mLSTM: a matrix memory with a max-plus stabiliser", "exact"),
    "zaya": ("q/k convs and delayed values inside the attention's projection (a halo)", "exact"),
}


@pytest.mark.parametrize("family", QUICK)
def test_family_equals_one_process_or_is_refused(pool, family):
    results = model_sweep.sweep_family(pool, family)
    outcome, why = model_sweep.verdict(results)
    assert outcome == QUICK[family][1], (family, results)
    assert re.search(rf"\| `{family}` \| [^|]+ \| [^|]+ \| {outcome} \|", model_sweep.MATRIX.read_text())


IMAGE_TEXT_QUICK = {  # image-text-to-text family on text: (what it exercises, its verdict)
    "mistral3": ("a config setting its forward's decorator passes (vision_feature_layer)", "exact"),
    "gemma3": ("a processor's token_type_ids of text", "exact"),
    "qwen3_vl": ("a processor's mm_token_type_ids of text; mRoPE positions", "exact"),
    "qwen3_omni_moe_thinker": ("a setting its forward passes from the text config", "exact"),
    "idefics2": ("a perceiver resampler over the image features, left to the tower", "exact"),
}


@pytest.mark.parametrize("family", IMAGE_TEXT_QUICK)
def test_image_text_class_on_text_equals_one_process(pool, family):
    results = model_sweep.sweep_family(pool, family, task="image_text")
    outcome, why = model_sweep.verdict(results)
    assert outcome == IMAGE_TEXT_QUICK[family][1], (family, results)
    if family in ("gemma3", "qwen3_vl"):
        assert "padded, token types" in results, results
    section = model_sweep.MATRIX.read_text().split("## Image-text-to-text classes")[1]
    assert re.search(rf"\| `{family}` \| [^|]+ \| [^|]+ \| {outcome} \|", section)


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_the_sweep_can_fail(pool, family):
    """The same cases without `parallelize` (each rank runs the model on its shard alone): wrong."""
    results = model_sweep.sweep_family(pool, family, cp=False, cases=["padded"])
    assert model_sweep.verdict(results)[0] == "wrong", results


def test_the_support_matrix_is_current():
    """docs/models.md was generated from today's adapter and zoo, on the installed transformers and
    TRL: `make models` regenerates it."""
    text = model_sweep.MATRIX.read_text()
    assert f"on {model_sweep.stamped()} (" in text, "docs/models.md is stale: run `make models`"
    assert "| wrong |" not in text and "| crash |" not in text


def test_a_mask_made_outside_the_forward_is_refused(pool):
    """The forward's context reaches the attention layers in the masks the pre-hook's forward makes;
    a mask made without it (the model called through a module the adapter did not hook) raises."""
    for message in pool.run(("first", 2), zoo_cases.mask_outside_the_forward, "llama")[0]:
        assert "made without the CP context" in message, message


def test_the_whole_model_compiles_as_one_graph(pool):
    """torch.compile(model, fullgraph=True) on packed rows: the pre-hook, the documents it makes and
    the masks that carry them trace with every layer; aot_eager runs the eager kernels, so the
    logits equal the eager model's bit for bit."""
    for difference in pool.run(("first", 2), zoo_cases.compiled_whole_model, "llama", "packed", timeout=300)[
        0
    ]:
        assert difference == 0.0, difference


STATE_SPACE = (
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "zamba2",
    "mamba2",
    "jamba",
    "zamba",
    "minimax",
    "recurrent_gemma",
    "xlstm",
    "zaya",
    "qwen4_exp_text",
    "deepseek_v4",
    "inkling2_text",
    "inkling_text",
    "minimax_m3_vl_text",
    "dots3_note_text",
)


# (family, case): what its refusal names (MiniMax-M3's indexer pools key slots from row 0, which
# in packed rows land in earlier documents: refused on every rank count, as in the sweep)
REFUSED_CASES = {("minimax_m3_vl_text", "packed"): "cannot take packed rows"}


@pytest.mark.parametrize("family", STATE_SPACE)
def test_state_space_families_on_four_ranks_with_checkpointing(pool, family):
    """The Mamba2, Mamba and lightning-attention families (and Qwen4, DeepSeek V4, Inkling, MiniMax-M3,
    dots3: QSA's blocks, the n-grams, the compressed windows, the relative logits and the sparse
    blocks span ranks)
    on 4 ranks (8 tokens a rank; head_tail: chunks of 4, so a state crosses three ranks), in train
    mode with activation checkpointing, every sweep case: exact."""
    for case in zoo.CASES:
        ranks = pool.run(("first", 4), zoo_cases.compare, family, case, True, True, timeout=120)[0]
        for result in ranks:
            if (family, case) in REFUSED_CASES:
                assert result["verdict"] == "refused", (family, case, result)
                assert REFUSED_CASES[family, case] in result["why"], (family, case, result)
            else:
                assert result["verdict"] == "exact", (family, case, result)


@pytest.mark.parametrize("case", ["padded", "padded, head_tail"])
def test_qwen4_ple_recomputed_without_the_forwards_context(pool, case):
    """Qwen4's per-layer embeddings under transformers' own activation checkpointing (no
    hf.checkpoint_kwargs(): the recomputation runs outside the forward's context) on padded rows:
    the padding the recomputed layer masks is its own argument's, so exact."""
    for result in pool.run(
        ("first", 2), zoo_cases.compare, "qwen4_exp_text", case, True, "plain", timeout=120
    )[0]:
        assert result["verdict"] == "exact", (case, result)


@pytest.mark.parametrize("family", ["deepseek_v4", "inkling2_text"])
def test_query_blocks(pool, family):
    """DeepSeek V4's compressed layers and Inkling2's relative-logit ones 5 queries at a time
    (blocks that cut the windows, the window's keys and the chunks unevenly) on 2 ranks with
    checkpointing, every sweep case: exact."""
    for case in zoo.CASES:
        ranks = pool.run(("first", 2), zoo_cases.compare_in_query_blocks, family, case, 5, timeout=120)[0]
        for result in ranks:
            assert result["verdict"] == "exact", (case, result)


@pytest.mark.parametrize(
    "case", [c if c == "packed" else pytest.param(c, marks=pytest.mark.slow) for c in zoo.CASES]
)
def test_inkling_log_scaling_at_the_global_rows(pool, case):
    """Inkling's full layers scale their queries and bias from row log_scaling_n_floor (4 here) on,
    by the rows the model counts locally (`arange`); on 4 ranks (8 tokens a rank: half of each
    rank's rows past the floor) every sweep case (both layouts, packed rows) is exact (the padded
    ones in `make test-all`; `make models` runs all three on 2 ranks)."""
    for result in pool.run(("first", 4), zoo_cases.compare, "inkling_text", case, timeout=120)[0]:
        assert result["verdict"] == "exact", (case, result)


def test_minimax_m3_refuses_left_padding(pool):
    """MiniMax-M3's indexer pools padding keys into its blocks: left-padded rows are refused (the
    sweep gives it right-padded ones, zoo.RIGHT_PADDED)."""
    for message in pool.run(("first", 2), zoo_cases.left_padding_refusal, "minimax_m3_vl_text", timeout=120)[
        0
    ]:
        assert message is not None and "padding before a real token" in message, message
