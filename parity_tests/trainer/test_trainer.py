"""hf.ContextParallelMixin: transformers' Trainer, TRL's SFTTrainer and RewardTrainer over dp x cp
processes equal the same trainer over dp processes without CP (parity_tests/trainer/trainer_jobs.py:
float64 models, dropout 0, SGD at learning rate 0.5, gradient accumulation 2, 3 steps, then
evaluate()).

Four torchrun launches, two at a time: cp 2 (2 processes) against one process, every case (Trainer
on padded rows of 13 to 31 tokens: Gemma 3, Mistral under head_tail, LFM2, Qwen3.5 (Gated DeltaNet)
under head_tail, Gemma 3 under FSDP2, with LoRA, and streamed from an IterableDataset; SFTTrainer
with packing: Gemma 3 and GPT-OSS (head_tail) on prompt-completion pairs, the loss on completions
only, Mistral on text, Gemma 3 with TRL's defaults, bf16 autocast and activation checkpointing, in
float64 and float32; SFTTrainer on images and text (TRL's vision collator, prompts with one or two
images, completion-only loss): Qwen2-VL (mRoPE, its processor's type ids; LLaVA and GLM-4.1V under
head_tail in the slow matrix), Gemma 4 (no loss kwargs; its images bidirectional on its sliding
layers), the vision tower and projector training too, and LLaVA in float32 under bf16
autocast with one image a batch (a CP rank encoding none), head_tail; Trainer on Gemma 4's text;
RewardTrainer on chosen / rejected pairs: Llama, Mistral under head_tail with centred rewards, with
LoRA, under FSDP2 and with TRL's defaults, every metric it logs compared;
DPOTrainer and KTOTrainer with a separate reference model, with LoRA (reference: the adapter off),
with precomputed reference log-probs, under FSDP2 and with TRL's defaults, every metric compared),
the five recipes, resume from a checkpoint (DDP and FSDP2) and the refusals; and
dp 2 x cp 2 (4 processes) against dp 2, DP_CASES and the refusals. The models are float64, but
transformers rounds their norms, and the logged loss, through float32: the logged loss and eval_loss
are float32 sums over a step's tokens (at most STEP_TOKENS), taken in another order on each side,
so within 2 STEP_TOKENS u32 of the loss; grad_norm and the parameters' change from their start
within 1e-5, relative (its largest entry) (after 3 steps the float32 norms' roundings grow to about
1e-6 of it here; a constant gradient scale moves it by tens of percent, a token misrouted in one row
by ~1e-2); a case's `rtol` where the model rounds more through float32 (Gemma 4's vision tower,
float32 whatever the model's dtype, on each rank's share of the images: 1e-4, its 3 steps' change
seen within 1.1e-5). The float32 model under bf16 autocast: within_bfloat16's bound.
"""

import pytest
import torch
import transformers

from parity_tests.harness import bounds, jobs
from parity_tests.hf import hf_models
from parity_tests.trainer import trainer_jobs
from torch_impl.hf.trainer import DROPPED_KEYS

U32 = bounds.u(torch.float32)
STEP_TOKENS = 2 * 2 * 2 * 48  # dp replicas x batch x accumulation x the longest row (SFT's packed 48)
DP_CASES = (
    "trainer_gemma3",
    "sft_gemma3_packed_completion",
    "sft_gpt_oss_packed_head_tail",
    "sft_gemma4_images",
    "trainer_gemma4",
    "trainer_gemma3_lora",
    "reward_llama",
    "dpo_mistral_head_tail",
    "kto_llama",
    "grpo_llama",
    "grpo_gemma3_head_tail_kl",
    "rloo_llama",
)
ROLLOUTS = ("grpo", "rloo")
COMPARED = [("cp2", "one", case) for case in trainer_jobs.CASES] + [("dp2cp2", "dp2", c) for c in DP_CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{launch: results}, the four launches run two at a time."""
    out = tmp_path_factory.mktemp("trainer")
    launches = {  # name: (processes, cp size, extra arguments)
        "cp2": (2, 2, ["--resume", "--refusals", "--recipes"]),
        "one": (1, 1, ["--recipes"]),
        "dp2cp2": (4, 2, ["--refusals", "--cases", ",".join(DP_CASES)]),
        "dp2": (2, 1, ["--cases", ",".join(DP_CASES)]),
    }
    results = {}
    for pair in (("cp2", "one"), ("dp2cp2", "dp2")):
        started = {}
        for name in pair:
            nproc, cp, extra = launches[name]
            args = ["--cp-size", str(cp), "--out", str(out / f"{name}.pt"), *extra]
            started[name] = jobs.torchrun("parity_tests.trainer.trainer_jobs", args, nproc)
        for name, proc in started.items():
            code, log = jobs.finish(proc, timeout=300)
            assert code == 0, log[-4000:]
            results[name] = torch.load(out / f"{name}.pt", weights_only=False)
    return results


@pytest.mark.parametrize("launch,reference,case", COMPARED)
def test_the_trainer_over_cp_equals_it_without(runs, launch, reference, case):
    compare(runs[launch][case], runs[reference][case], case)


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    """trainer_jobs.MATRIX at cp 2 (2 processes) and in one process, side by side."""
    out, cases = tmp_path_factory.mktemp("matrix"), ",".join(trainer_jobs.MATRIX)
    started = {
        name: jobs.torchrun(
            "parity_tests.trainer.trainer_jobs",
            ["--cp-size", str(n), "--cases", cases, "--out", str(out / f"{name}.pt")],
            n,
        )
        for name, n in (("cp2", 2), ("one", 1))
    }
    results = {}
    for name, proc in started.items():
        code, log = jobs.finish(proc, timeout=280)
        assert code == 0, log[-4000:]
        results[name] = torch.load(out / f"{name}.pt", weights_only=False)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", trainer_jobs.MATRIX)
def test_every_loss_type_over_cp_equals_it_without(matrix_runs, case):
    """TRL's own loss on whole rows under CP: every DPO loss type and f-divergence, KTO's other
    loss type, every GRPO loss type at both importance-sampling levels; SFT on LLaVA with images
    (head_tail); to the bounds above."""
    compare(matrix_runs["cp2"][case], matrix_runs["one"][case], case)


def compare(got, want, case):
    """A case's run over CP (`got`) against its run without (`want`): the bounds of the module's
    docstring, and each trainer's metrics below. A DPO loss that weighs each row by a steep
    function of its log-ratio (`steep`: DiscoPOP's sigmoid(beta r / tau), tau 0.05; the forward
    KL's exp(-r)) turns the float32 rounding of a row's log-prob (64 u32 of the largest logged,
    about 60 here, summed by TRL over whole rows on both sides) into up to that relative change of
    the row's gradient: the parameters within it, 3e-4 here, where a misrouted token moves them
    by ~1e-2."""
    steps = [h["step"] for h in want["log"]]
    assert [h["step"] for h in got["log"]] == steps == [1, 2, 3]
    kind, _, _, extra = trainer_jobs.EVERY_CASE[case]
    if kind in ROLLOUTS:
        completions_table(got, want)
    if extra.get("dtype") == "float32" or extra.get("bf16_head"):  # under bf16 autocast
        bound = within_bfloat16(got, want, case)
        if kind in ("trainer", "sft"):
            token_metrics(got, want, bound)
        return None
    if kind in ROLLOUTS:
        rollout_metrics(got, want)
    if kind in ("trainer", "sft"):
        token_metrics(got, want, 64 * U32)
    for g, w in zip(got["log"], want["log"], strict=True):
        if kind in ROLLOUTS:  # checked above
            break
        bounds.check(
            abs(g["loss"] - w["loss"]), 2 * STEP_TOKENS * U32 * abs(w["loss"]), f"step {w['step']} loss"
        )
        bounds.check(
            abs(g["grad_norm"] - w["grad_norm"]),
            extra.get("rtol", 1e-5) * w["grad_norm"],
            f"step {w['step']} grad_norm",
        )
    if kind == "reward":
        reward_metrics(got, want)
    if kind in ("dpo", "kto"):
        preference_metrics(got, want)
    loss_bound = 2 * STEP_TOKENS * U32 * abs(want["eval_loss"])
    if kind in ROLLOUTS:
        loss_bound = 64 * U32
    bounds.check(abs(got["eval_loss"] - want["eval_loss"]), loss_bound, "eval_loss")
    start, rtol = trainer_jobs.initial_params(case), extra.get("rtol", 1e-5)
    if extra.get("steep"):  # a loss whose row weight is steep in the row's log-ratio: see below
        logps = [abs(v) for h in want["log"] for k, v in h.items() if k.startswith("logps/")]
        rtol = max(rtol, 64 * U32 * max(logps))
    for key, w in want["params"].items():
        change = w - start[key]
        apart = (got["params"][key] - w).abs().max()
        bounds.check(apart, rtol * change.abs().max().item() + 1e-14, f"{key} after 3 steps")


def token_metrics(got, want, bound):
    """transformers' Trainer and TRL's SFTTrainer: every other metric they log in training and
    evaluate(): the tokens counted (`num_input_tokens_seen`, SFT's `num_tokens`) exactly; SFT's
    entropy and token accuracy, which its fused LM head computes per token in float32 on both
    sides and sums over the batch in another order, within `bound` of the larger of the value
    and 1 (64 u32; under bf16 autocast within_bfloat16's)."""
    for g, w in [*zip(got["log"], want["log"], strict=True), (got["eval"], want["eval"])]:
        assert g.keys() == w.keys(), g.keys() ^ w.keys()
        for key in w.keys() - {"loss", "grad_norm", "learning_rate", "epoch", "step", "eval_loss"}:
            if key.endswith(("num_tokens", "num_input_tokens_seen")):
                assert g[key] == w[key], (w.get("step"), key, g[key], w[key])
            else:
                bounds.check(
                    abs(g[key] - w[key]), bound * max(abs(w[key]), 1.0), f"step {w.get('step')} {key}"
                )


def completions_table(got, want):
    """GRPO's and RLOO's completions table (what TRL logs per completion: prompts, completions,
    rewards, advantages), as rank 0 holds it: the dp-only run's rows, once each. The completions
    are the same tokens, the rewards computed alike from them; an advantage (RLOO's with its KL
    penalty: a difference of float32 log-probs) within 64 u32 of the larger of it and 1."""
    got, want = got["completions"], want["completions"]
    assert got.keys() == want.keys(), got.keys() ^ want.keys()
    for key, values in want.items():
        assert len(got[key]) == len(values), (key, len(got[key]), len(values))
        if key != "advantages":
            assert got[key] == values, key
            continue
        for g, w in zip(got[key], values, strict=True):
            bounds.check(abs(g - w), 64 * U32 * max(abs(w), 1.0), "advantage")


def reward_metrics(got, want):
    """RewardTrainer: every metric it logs in training and evaluate() (num_tokens, min, mean and max
    reward, accuracy, margin)
    equal within float64 roundings taken in another order (a reward's attention and sums over the
    rows gathered from every process): 1e-12 of the larger of the value and 1."""
    for g, w in [*zip(got["log"], want["log"], strict=True), (got["eval"], want["eval"])]:
        assert g.keys() == w.keys(), (g.keys(), w.keys())
        for key in w.keys() - {"loss", "grad_norm", "learning_rate", "epoch", "step"}:
            bounds.check(abs(g[key] - w[key]), 1e-12 * max(abs(w[key]), 1.0), f"step {w.get('step')} {key}")


def preference_metrics(got, want):
    """DPOTrainer and KTOTrainer: every metric they log in training and evaluate() (entropy, mean
    logits, token accuracy, rewards, margins, log-probs, KL, num_tokens). TRL's fused LM head
    computes each token's log-prob in float32 on both sides: a value within
    64 u32 of the largest magnitude it is built from, its own or (rewards, margins, KL: differences
    of a row's log-probs) the largest row log-prob logged; num_tokens exactly."""
    for g, w in [*zip(got["log"], want["log"], strict=True), (got["eval"], want["eval"])]:
        assert g.keys() == w.keys(), (g.keys(), w.keys())
        prefix = "eval_" if "eval_loss" in w else ""
        logps = max(abs(w[key]) for key in w if key.startswith(f"{prefix}logps/"))
        for key in w.keys() - {"loss", "grad_norm", "learning_rate", "epoch", "step", "eval_loss"}:
            if key.endswith("num_tokens"):
                assert g[key] == w[key], (key, g[key], w[key])
                continue
            scale = logps if key.startswith((f"{prefix}rewards/", f"{prefix}kl")) else max(abs(w[key]), 1.0)
            bounds.check(abs(g[key] - w[key]), 64 * U32 * scale, f"step {w.get('step')} {key}")


def rollout_metrics(got, want):
    """GRPOTrainer and RLOOTrainer: the loss, grad_norm and every metric they log in training and
    evaluate()
    (completion lengths, rewards, their spread, entropy, KL, clip ratios, num_tokens). The
    completions are the same tokens (each length, reward and `num_tokens` exactly equal); TRL's
    fused LM head computes each token's log-prob in float32 on both sides, summed over at most a
    step's 2 x 48 completion tokens in another order: the loss (a mean over tokens of ratios
    times advantages of at most a few units) and every other value within 64 u32 of the larger of
    it and 1; grad_norm within 1e-5 of it, as the others."""
    for g, w in [*zip(got["log"], want["log"], strict=True), (got["eval"], want["eval"])]:
        assert g.keys() == w.keys(), g.keys() ^ w.keys()
        for key in w.keys() - {"learning_rate", "epoch", "step", "step_time", "eval_loss"}:
            if key.removeprefix("eval_").startswith(("num_tokens", "completions/", "rewards/", "reward")):
                assert g[key] == w[key], (key, g[key], w[key])
            elif key == "grad_norm":
                bounds.check(abs(g[key] - w[key]), 1e-5 * w[key], f"step {w['step']} grad_norm")
            else:
                bounds.check(
                    abs(g[key] - w[key]), 64 * U32 * max(abs(w[key]), 1.0), f"step {w.get('step')} {key}"
                )


def within_bfloat16(got, want, case):
    """A float32 model under TRL's bf16 autocast: every matmul's inputs are rounded to bfloat16
    (u = 2^-8) on each side, from float32 values that differ by float32 roundings taken in another
    order, so a rounding may land one bfloat16 ulp (2u) apart; each layer adds at most that to
    the loss and grad_norm, relative, on each side: within 2 * 2u * layers of them. Returns that
    bound (relative)."""
    kind, name, _, extra = trainer_jobs.EVERY_CASE[case]
    model = trainer_jobs.model_of(kind, name, {**extra, "lora": False})
    bound = 4 * bounds.u(torch.bfloat16) * model.config.get_text_config().num_hidden_layers
    floor = 1.0 if trainer_jobs.EVERY_CASE[case][0] in ROLLOUTS else 0.0  # their loss: about 0 (advantages)
    for g, w in zip(got["log"], want["log"], strict=True):
        for key in ("loss", "grad_norm"):
            bounds.check(abs(g[key] - w[key]), bound * max(abs(w[key]), floor), f"step {w['step']} {key}")
    scale = max(abs(want["eval_loss"]), floor)
    bounds.check(abs(got["eval_loss"] - want["eval_loss"]), bound * scale, "eval_loss")
    return bound


def test_precomputed_reference_log_probs_are_sharded_as_a_training_step(runs):
    """DPO's `precompute_ref_log_probs`: TRL's pass of the reference over the dataset runs once the
    model is made CP, its fused-head calls sharded (every rank's every batch), so that a rank holds
    a shard's activations, not a whole row's; the run equals the one without CP (above)."""
    for rank in runs["cp2"]["dpo_llama_precomputed"]["reference_passes"]:
        assert rank and all(rank), rank
    assert runs["one"]["dpo_llama_precomputed"]["reference_passes"][0]  # the pass ran there too


@pytest.mark.parametrize("launch", ["cp2", "dp2cp2"])
def test_the_model_never_receives_the_flash_attention_keys(runs, launch):
    """TRL's padding-free collator adds cu_seq_lens_*, max_length_* and seq_idx (one process's
    model receives them); under CP the documents travel in position_ids, and a rank's own
    cu_seqlens would be wrong (a Mamba layer refuses them), so the mixin drops them."""
    for case, result in runs[launch].items():
        if case in trainer_jobs.CASES:
            for received in result["received"]:
                assert not set(received) & set(DROPPED_KEYS), (case, received)
    assert set(DROPPED_KEYS) <= set(runs["one"]["sft_mistral_packed"]["received"][0])


@pytest.mark.parametrize("launch", ["cp2", "one", "dp2cp2", "dp2"])
def test_a_lora_adapter_saved_under_cp_loads_into_the_plain_model(runs, launch):
    adapter = runs[launch]["trainer_gemma3_lora"]["adapter"]
    assert len(adapter) == 2 * 4 * 3 and all(adapter.values()), adapter  # A and B, 4 projections, 3 layers


def test_trl_checkpointing_keeps_the_transports_and_the_attentions_outputs(runs):
    """SFTConfig turns activation checkpointing on; the mixin makes it hf.checkpoint_kwargs()'s."""
    for case, (kind, *_) in trainer_jobs.CASES.items():
        if kind == "sft":
            assert "_checkpoint_contexts" in runs["cp2"][case]["checkpointing"], case
            assert "context_fn" not in runs["one"][case]["checkpointing"], case


@pytest.mark.parametrize("launch,dp", [("cp2", 1), ("dp2cp2", 2)])
def test_a_replicas_cp_ranks_get_the_same_rows_and_replicas_disjoint_ones(runs, launch, dp):
    for case, result in runs[launch].items():
        if case not in trainer_jobs.CASES:
            continue
        rows = result["rows"]  # per rank: per micro-batch, its rows' token ids
        cp = len(rows) // dp
        for d in range(dp):
            assert all(rows[d * cp + c] == rows[d * cp] for c in range(cp)), case
        for step in range(len(rows[0])):
            seen = [set(rows[d * cp][step]) for d in range(dp)]
            assert sum(len(s) for s in seen) == len(set().union(*seen)), (case, step)


@pytest.mark.parametrize("case", ["trainer_gemma3", "trainer_gemma3_fsdp2"])
def test_resuming_from_a_checkpoint_equals_the_uninterrupted_run(runs, case):
    """The last checkpoint loads as the plain model with the uninterrupted run's parameters (FSDP2's
    sharded one once merged, as `accelerate merge-weights` does, in this process)."""
    resumed = runs["cp2"][f"resume {case}"]
    saved = resumed["checkpoint"]
    if case.endswith("fsdp2"):
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(f"{saved}/pytorch_model_fsdp_0", f"{saved}/merged")
        hf_models.build("gemma3").config.save_pretrained(f"{saved}/merged")  # shards carry no config
        saved = f"{saved}/merged"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64)
    assert (type(reloaded).__name__, reloaded.config._attn_implementation) == ("Gemma3ForCausalLM", "sdpa")
    for key, p in reloaded.named_parameters():
        assert torch.equal(p, resumed["uninterrupted"][key]), key
    assert [h["step"] for h in resumed["log"]] == [1, 2, 3]  # 1, 2 from the checkpoint's state
    assert resumed["log"][-1] == resumed["uninterrupted_log"][-1]
    for key, p in resumed["uninterrupted"].items():
        assert torch.equal(resumed["resumed"][key], p), key


@pytest.mark.parametrize("launch", ["cp2", "dp2cp2"])
def test_what_cannot_be_exact_is_refused_on_every_rank(runs, launch):
    said = runs[launch]["refusals"]
    world = len(said)
    assert world == (2 if launch == "cp2" else 4)
    for rank in said:
        assert f"`cp_size` ({world + 1}) must divide the number of processes ({world})" in rank["cp_size"]
        assert "`label_smoothing_factor > 0` is not supported" in rank["label_smoothing"]
        assert "`compute_metrics` is not supported" in rank["compute_metrics"]
        assert "router's auxiliary loss would be each CP rank's own" in rank["router_aux_loss"]
        assert "router_aux_loss_coef=0.0 in the SFTConfig" in rank["router_aux_loss"]
        assert "pass accelerator_config={'dispatch_batches': False}" in rank["dispatch_batches"]
        assert (
            "LlamaForSequenceClassification: a sequence classification loss"
            in rank["sequence_classification"]
        )
        assert "NoKwargs's forward takes no `**kwargs`" in rank["no_loss_kwargs"]
        replicas = f"cp_size={world} over {world} processes leaves 1 data-parallel replica(s)"
        assert f"TRL's GRPOTrainer with {replicas}" in rank["grpo_train_batch"], rank["grpo_train_batch"]
        assert "generation batch of 4 rows" in rank["grpo_train_batch"]
        assert "must be divisible by num_generations (8)" in rank["grpo_train_batch"]
        assert "evaluation batch of 4 rows" in rank["grpo_eval_batch"], rank["grpo_eval_batch"]


@pytest.mark.parametrize("recipe", ["trainer", "sft", "dpo", "grpo", "vlm"])
def test_the_recipes_over_cp_equal_them_without(runs, recipe):
    """The recipes' float32 models: every step in float32, the attention's sums of up to 48 keys
    rounding in another order (2 (2T + D) u32, T = 48, D = 16: 224 u32) on both sides, and the loss's
    float32 sum over a step's tokens (dp 1: 2 x 2 x 48 at most) in another order. GRPO's
    completions are the same tokens (each step's mean reward exactly equal), and its loss, a mean
    of ratios times advantages that cancel to about 0, is bounded by the larger of it and 1."""
    got, want = runs["cp2"][f"examples.recipes.{recipe}"], runs["one"][f"examples.recipes.{recipe}"]
    assert [h["step"] for h in got["log"]] == [h["step"] for h in want["log"]] == [1, 2, 3]
    c = 2 * (224 + 2 * 2 * 48)
    floor = {"loss": 1.0 if recipe == "grpo" else 0.0, "grad_norm": 0.0}
    for g, w in zip(got["log"], want["log"], strict=True):
        for key in ("loss", "grad_norm"):
            scale = max(abs(w[key]), floor[key])
            bounds.check(abs(g[key] - w[key]), c * U32 * scale, f"step {w['step']} {key}")
        if recipe == "grpo":
            assert g["reward"] == w["reward"], (w["step"], g["reward"], w["reward"])
    scale = max(abs(want["eval_loss"]), floor["loss"])
    bounds.check(abs(got["eval_loss"] - want["eval_loss"]), c * U32 * scale, "eval_loss")


def test_shard_pads_a_cross_attention_mask_along_its_rows():
    """The mixin's `shard` pads Mllama's cross_attention_mask [B, S, images, tiles] along the rows
    (zeros: a padding token sees no image), as it pads the tokens to what the layout needs."""
    from types import SimpleNamespace

    from torch_impl.hf.trainer import ContextParallelMixin

    trainer = SimpleNamespace(cp_size=2, cp_layout="head_tail", cp_group=None, _pad_id=lambda: 0)
    ids, sees = torch.arange(1, 11).view(1, 10), torch.ones(1, 10, 2, 3, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "cross_attention_mask": sees}
    local = ContextParallelMixin.shard(trainer, batch)  # (no group: the whole padded batch)
    assert local["input_ids"].shape == (1, 12) and local["cross_attention_mask"].shape == (1, 12, 2, 3)
    assert torch.equal(local["cross_attention_mask"][:, :10], sees)
    assert not local["cross_attention_mask"][:, 10:].any()
