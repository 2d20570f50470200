"""What the Trainer tests run under torchrun: several cases in one launch, each a transformers
Trainer or TRL SFTTrainer on a float64 model (hf_models, dropout 0), with `hf.ContextParallelMixin`
(`--cp-size` > 1) or without it (`--cp-size 1`: the same trainer over the dp processes, the
reference). Rank 0 writes {case: result} to `--out` (torch.save): the logged steps, eval_loss, the
final parameters, and per rank the rows (each sequence's token ids) every training step received.

    torchrun --standalone --nproc-per-node 4 -m parity_tests.trainer.trainer_jobs --cp-size 2 --out FILE
"""

import argparse
import gc
import os

from datasets import Dataset
import torch
import torch.distributed as dist
import transformers as tf
import trl
from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    SFTTrainer,
)

from cp_support.trainers import FSDP2, LORA_TARGETS, FSDP2OnCPU
from examples.recipes import dpo, grpo, sft, trainer, trainer_data, vlm
from parity_tests.hf import hf_models
from parity_tests.hf.hf_reference import float64_steps
from torch_impl import hf
from torch_impl.hf.batch import IGNORE_INDEX

# name: (trainer, model, layout, extra arguments)
CASES = {
    "trainer_gemma3": ("trainer", "gemma3", "contiguous", {}),
    "trainer_mistral_head_tail": ("trainer", "mistral", "head_tail", {}),
    "trainer_lfm2": ("trainer", "lfm2", "contiguous", {}),  # packed rows: one process refuses LFM2
    "trainer_qwen3_5_head_tail": ("trainer", "qwen3_5", "head_tail", {}),  # Gated DeltaNet
    "sft_gemma3_packed_completion": ("sft", "gemma3", "contiguous", {}),
    "sft_mistral_packed": ("sft", "mistral", "contiguous", {"text": True}),
    "sft_gpt_oss_packed_head_tail": ("sft", "gpt_oss", "head_tail", {}),
    # images and text (examples/recipes/vlm.py's rows, TRL's vision collator): Qwen2-VL, its vision
    # tower and projector training, each rank encoding its share of a batch's images; mRoPE
    # positions over the whole row, its processor's mm_token_type_ids (LLaVA: MATRIX, the recipe)
    "sft_qwen2_vl_images": ("sft", "qwen2_vl", "contiguous", {"images": True}),
    # Gemma 4 (its images bidirectional on its sliding layers; GLM-4.1V: MATRIX) and transformers'
    # Trainer on Gemma 4's text: classes that take no loss kwargs, each micro-batch its own mean.
    # Its vision tower computes in float32 (its attention, pooling and scaling, whatever the
    # model's dtype), on each rank's share of the images: test_trainer's `rtol`
    "sft_gemma4_images": ("sft", "gemma4", "contiguous", {"images": True, "rtol": 1e-4}),
    "trainer_gemma4": ("trainer", "gemma4", "contiguous", {}),
    # LLaVA in float32 under TRL's bf16 autocast, a row and one image a batch: one CP rank encodes
    # none and sends the projector's dtype (bfloat16), not its embeddings' float32
    "sft_llava_one_image_bf16_head_tail": (
        "sft",
        "llava",
        "head_tail",
        {
            "images": True,
            "one_image": True,
            "dtype": "float32",
            "args": {"bf16": None, "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1},
        },
    ),
    # TRL's defaults (bf16 autocast, activation checkpointing) on a float64 model (autocast leaves
    # float64 as it is) and a float32 one; evaluated on long prompts with short completions, so that
    # a CP rank's shard of a row holds no label
    "sft_gemma3_trl_defaults": (
        "sft",
        "gemma3",
        "contiguous",
        {"args": {"bf16": None, "per_device_eval_batch_size": 1}, "eval": "long"},
    ),
    "sft_gemma3_trl_defaults_float32": (
        "sft",
        "gemma3",
        "contiguous",
        {"args": {"bf16": None}, "dtype": "float32"},
    ),
    # FSDP2 over every process (dp x cp flattened), as accelerate shards it
    "trainer_gemma3_fsdp2": ("trainer", "gemma3", "contiguous", {"fsdp": True}),
    # LoRA (r 4 on the attention's projections) through PEFT: only the adapters train; and under FSDP2
    "trainer_gemma3_lora": ("trainer", "gemma3", "contiguous", {"lora": True}),
    "trainer_gemma3_fsdp2_lora": ("trainer", "gemma3", "contiguous", {"lora": True, "fsdp": True}),
    # rows streamed from an IterableDataset, each process reading its own (dispatch_batches=False);
    # evaluated on rows labelled on their last 3 tokens only: rank 0's half holds no label
    "trainer_gemma3_iterable": ("trainer", "gemma3", "contiguous", {"iterable": True, "eval": "long"}),
    # a reward model (LlamaForSequenceClassification, one label) on chosen / rejected pairs padded
    # on the right: its reward read at each row's last real token, which one CP rank holds
    "reward_llama": ("reward", "llama", "contiguous", {}),
    "reward_mistral_head_tail": (
        "reward",
        "mistral",
        "head_tail",
        {"args": {"center_rewards_coefficient": 0.1}},
    ),
    "reward_llama_lora": ("reward", "llama", "contiguous", {"lora": True}),
    "reward_llama_fsdp2": ("reward", "llama", "contiguous", {"fsdp": True}),
    # TRL's defaults: bf16 autocast (which leaves float64 as it is) and activation checkpointing
    "reward_llama_trl_defaults": ("reward", "llama", "head_tail", {"args": {"bf16": None}}),
    # DPO on chosen / rejected completions of 2 to 30 words after prompts of 3 to 6, padded on the
    # right: a separate reference model (other weights), IPO and SFT terms (per-row and batch
    # token counts) with LD-DPO's tail weight (positions within a completion), LoRA (the
    # reference: the adapter off) with WPO's weights (the head's log-sum of squared
    # probabilities; TRL's SFT term cannot take them), precomputed reference log-probs, FSDP2,
    # TRL's defaults (bf16 autocast, activation checkpointing)
    "dpo_llama": ("dpo", "llama", "contiguous", {"ref": True}),
    "dpo_mistral_head_tail": (
        "dpo",
        "mistral",
        "head_tail",
        {
            "ref": True,
            "args": {
                "loss_type": ["sigmoid", "ipo", "sft"],
                "loss_weights": [1.0, 0.5, 0.2],
                "ld_alpha": 0.5,
            },
        },
    ),
    "dpo_llama_lora": ("dpo", "llama", "contiguous", {"lora": True, "args": {"use_weighting": True}}),
    "dpo_llama_precomputed": ("dpo", "llama", "head_tail", {"args": {"precompute_ref_log_probs": True}}),
    "dpo_llama_fsdp2": ("dpo", "llama", "contiguous", {"ref": True, "fsdp": True}),
    # under bf16 autocast TRL's fused LM head computes in bfloat16 (its kernel takes the autocast
    # dtype), even for a float64 model
    "dpo_llama_trl_defaults": (
        "dpo",
        "llama",
        "head_tail",
        {"ref": True, "args": {"bf16": None}, "bf16_head": True},
    ),
    # KTO on unpaired completions, desirable or not: its KL term from mismatched pairs
    "kto_llama": ("kto", "llama", "contiguous", {"ref": True}),
    "kto_mistral_head_tail_lora": ("kto", "mistral", "head_tail", {"lora": True}),
    # GRPO: completions of up to 12 tokens sampled after prompts of 3 to 6 words, 4 a prompt,
    # rewarded by their share of even token ids. TRL's default loss (dapo); a replica's CP
    # ranks whose random states differ from the start (CP rank 0's completions must reach them);
    # GRPO's per-sequence loss with sequence-level ratios, two passes over each generation (the
    # old policy's log-probs) and a KL to a separate reference; a hybrid model (Gated DeltaNet);
    # VESPO with the off-policy mask, the high-entropy token mask and an entropy bonus; LoRA (the
    # reference: the adapter off); FSDP2; TRL's defaults (bf16 autocast, checkpointing)
    "grpo_llama": ("grpo", "llama", "contiguous", {"desync": True}),
    "grpo_gemma3_head_tail_kl": (
        "grpo",
        "gemma3",
        "head_tail",
        {
            "ref": True,
            "args": {
                "loss_type": "grpo",
                "importance_sampling_level": "sequence",
                "beta": 0.04,
                "num_iterations": 2,
            },
        },
    ),  # fmt: skip
    "grpo_qwen3_5": ("grpo", "qwen3_5", "contiguous", {}),
    "grpo_mistral_vespo": (
        "grpo",
        "mistral",
        "contiguous",
        {
            "args": {
                "loss_type": "vespo",
                "off_policy_mask_threshold": 0.05,
                "top_entropy_quantile": 0.5,
                "entropy_coef": 0.01,
                "steps_per_generation": 4,
            }
        },
    ),  # fmt: skip
    "grpo_llama_lora_kl": ("grpo", "llama", "head_tail", {"lora": True, "args": {"beta": 0.04}}),
    "grpo_llama_fsdp2": ("grpo", "llama", "contiguous", {"fsdp": True}),
    "grpo_llama_trl_defaults": (
        "grpo",
        "llama",
        "contiguous",
        {"args": {"bf16": None, "gradient_checkpointing": None}, "bf16_head": True},
    ),
    # RLOO, on GRPO's rows: its default KL penalty in the reward (beta 0.05) to a separate
    # reference, a replica's CP ranks desynced; a hybrid model with normalised advantages and two
    # passes over each generation (a row's ratio to the old policy); LoRA (the reference: the
    # adapter off); FSDP2; TRL's defaults (bf16 autocast, checkpointing)
    "rloo_llama": ("rloo", "llama", "contiguous", {"ref": True, "desync": True}),
    "rloo_qwen3_5_head_tail": (
        "rloo",
        "qwen3_5",
        "head_tail",
        {"args": {"beta": 0.0, "num_iterations": 2, "normalize_advantages": True}},
    ),
    "rloo_llama_lora": ("rloo", "llama", "head_tail", {"lora": True}),
    "rloo_llama_fsdp2": ("rloo", "llama", "contiguous", {"fsdp": True, "args": {"beta": 0.0}}),
    "rloo_llama_trl_defaults": (
        "rloo",
        "llama",
        "contiguous",
        {"args": {"beta": 0.0, "bf16": None, "gradient_checkpointing": None}, "bf16_head": True},
    ),
}
# the option matrix (`make test-all`: test_trainer.py's slow case): TRL's own loss under CP for
# every DPO loss type (label smoothing 0.1: exo_pair needs it, robust and aot read it) and
# f-divergence (`steep`: test_trainer.compare's bound), KTO's other loss type, every GRPO loss
# type at both importance-sampling levels (two passes over each generation, so that ratios leave
# 1 and clip); Llama, the layouts alternating
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LAYOUTS = ("contiguous", "head_tail")
MATRIX = {
    **{
        f"dpo_{loss}": (
            "dpo",
            "llama",
            LAYOUTS[i % 2],
            {"ref": True, "args": {"loss_type": [loss], "label_smoothing": 0.1}, "steep": loss == "discopop"},
        )
        for i, loss in enumerate(DPO_LOSS_TYPES)
    },
    **{
        f"dpo_{kind}": (
            "dpo",
            "llama",
            LAYOUTS[i % 2],
            {"ref": True, "args": {"f_divergence_type": kind}, "steep": kind == "forward_kl"},
        )
        for i, kind in enumerate(("forward_kl", "js_divergence", "alpha_divergence"))
    },
    "kto_apo_zero_unpaired": (
        "kto",
        "llama",
        "head_tail",
        {"ref": True, "args": {"loss_type": "apo_zero_unpaired"}},
    ),
    **{
        f"grpo_{loss}_{level}": (
            "grpo",
            "llama",
            LAYOUTS[i % 2],
            {
                "args": {
                    "loss_type": loss,
                    "importance_sampling_level": level,
                    "num_iterations": 2,
                    "epsilon": 0.05,
                }
            },
        )
        for i, (loss, level) in enumerate(
            (loss, level) for loss in GRPO_LOSS_TYPES for level in ("token", "sequence")
        )
    },
}
MATRIX["sft_llava_images_head_tail"] = ("sft", "llava", "head_tail", {"images": True})
MATRIX["sft_glm4v_images_head_tail"] = ("sft", "glm4v", "head_tail", {"images": True})
# Gemma 4's count with TRL's per-process count (no factor of the processes to take back out)
MATRIX["sft_gemma4_images_per_process"] = (
    "sft",
    "gemma4",
    "contiguous",
    {"images": True, "rtol": 1e-4, "args": {"average_tokens_across_devices": False}},
)
EVERY_CASE = CASES | MATRIX
STREAMED = {"accelerator_config": {"dispatch_batches": False}}
COUNTED = {"include_num_input_tokens_seen": True}  # every case logs the tokens its batches held
# GRPO and RLOO: 2 prompts a generation (a micro-batch: one prompt's 4 completions), TRAINING's
# SGD steps
GRPO_TRAINING = trainer.TRAINING | dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    num_generations=4,
    max_completion_length=12,
    bf16=False,
    gradient_checkpointing=False,
)


def prompt_rows(n, seed):
    """GRPO's and RLOO's dataset: n prompts of 3 to 6 random words."""
    return Dataset.from_dict({"prompt": trainer_data.sentences(n, 3, 6, seed)})


def even_tokens(prompts, completions, completion_ids, **kwargs):
    """A reward: each completion's share of even token ids."""
    return [sum(1.0 for i in ids if i % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def saved_as_reference(model, path):
    """GRPO's and RLOO's reference (beta > 0, no PEFT): TRL loads it from the policy's path, so the model is
    saved there first (by rank 0) and names it: the reference is its initial weights."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    model.config._name_or_path = path
    return model


class Desynced(tf.TrainerCallback):
    """Tests only: the random states of every CP rank but the first made different from the dp-only
    run's at the start of training, so that only CP rank 0's samples can be the dp-only run's
    (torch_impl.hf.rl.agree broadcasts them)."""

    def __init__(self, cp_size):
        self.cp_size = cp_size

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cp_size > 1 and dist.get_rank() % self.cp_size:
            from accelerate.utils import set_seed

            set_seed(1000 + dist.get_rank())


class Streamed(torch.utils.data.IterableDataset):
    """`rows`, streamed."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class Rows:
    """A trainer mixin recording the rows of every training batch (before CP shards them), and per
    batch of a precomputed reference pass whether its fused-head calls were sharded over CP. Its
    training steps keep a linear-attention model's float32 steps in float64
    (hf_reference.float64_steps: its recurrences' float32 rounding, in another order, is within no
    bound relative to a gradient that sums to near zero; test_recurrent bounds the float32 kernels)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        with float64_steps(self.model):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_ref_log_probs(self, model, inputs):  # DPO's and KTO's precomputed reference pass
        self.reference_passes.append(getattr(self, "cp_whole_rows", False))  # sharded over CP or not
        return super().compute_ref_log_probs(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            ids = inputs.get("input_ids")
            if ids is None:  # GRPO's and RLOO's generated rows
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            self.rows.append([tuple(row.tolist()) for row in ids])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def classes(kind, fsdp=False):
    """(the plain trainer class, its CP version), both recording their rows (under FSDP2)."""
    base = {
        "trainer": tf.Trainer,
        "sft": SFTTrainer,
        "reward": RewardTrainer,
        "dpo": DPOTrainer,
        "kto": KTOTrainer,
        "grpo": trl.GRPOTrainer,
        "rloo": trl.RLOOTrainer,
    }[kind]
    extra = (FSDP2OnCPU,) if fsdp else ()
    return type("Plain", (Rows, *extra, base), {}), type(
        "CP", (Rows, hf.ContextParallelMixin, *extra, base), {}
    )


def model_of(kind, name, extra):
    """The case's model: hf_models' seeded weights (the same on every rank), a PEFT LoRA model of
    it where the case asks."""
    if kind == "reward":
        model = hf_models.build_head("ForSequenceClassification", name, num_labels=1)
    elif extra.get("images"):
        build = {
            "llava": vlm.llava,
            "qwen2_vl": hf_models.qwen2_vl,
            "gemma4": hf_models.gemma4,
            "glm4v": hf_models.glm4v,
        }[name]
        model = build(getattr(torch, extra.get("dtype", "float64")))
    elif name == "gemma4":  # (its class sets accepts_loss_kwargs = False: the trainer gives no count)
        model = hf_models.gemma4(getattr(torch, extra.get("dtype", "float64")))
    else:
        model = hf_models.build(name, getattr(torch, extra.get("dtype", "float64")))
    model.config.pad_token_id = 0
    if extra.get("lora"):
        import peft

        torch.manual_seed(0)  # A drawn from the seeded generator, B zero
        model = peft.get_peft_model(model, lora_config(kind))
    return model


def lora_config(kind):
    import peft

    task = {"task_type": "SEQ_CLS"} if kind == "reward" else {}  # the score head trains too
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, **task)


def build(kind, name, layout, extra, cp_size, output_dir, **overrides):
    """The case's trainer (not trained yet)."""
    plain, cp = classes(kind, extra.get("fsdp", False))
    # DPO and KTO wrap the model in LoRA themselves (peft_config): their reference is then the
    # model with its adapter off (given a PEFT model, they would copy its adapter as the reference)
    wrapped_by_trl = kind in ("dpo", "kto", "grpo", "rloo") and extra.get("lora")
    model = model_of(kind, name, {**extra, "lora": False} if wrapped_by_trl else extra)
    received = set()  # every keyword the model's forward is given
    model.register_forward_pre_hook(lambda module, args, kw: received.update(kw), with_kwargs=True)
    kwargs = {} if cp_size == 1 else {"cp_size": cp_size, "cp_layout": layout}
    overrides = COUNTED | extra.get("args", {}) | (FSDP2 if extra.get("fsdp") else {}) | overrides
    if kind == "trainer":
        rows = trainer_data.token_rows(48, 13, 31, seed=0)
        if extra.get("iterable"):
            rows, overrides = Streamed(rows), STREAMED | overrides
        args = trainer.training_args(output_dir, **overrides)
        evaluated = trainer_data.token_rows(8, 13, 31, seed=1)
        if extra.get("eval") == "long":
            evaluated = trainer_data.token_rows(8, 36, 40, seed=1)
            for row in evaluated:
                row["labels"] = [IGNORE_INDEX] * (len(row["labels"]) - 3) + row["labels"][-3:]
        data = dict(
            train_dataset=rows,
            eval_dataset=evaluated,
            data_collator=trainer_data.pad_rows,
        )
    elif kind in ("dpo", "kto"):
        config = {"dpo": DPOConfig, "kto": KTOConfig}[kind]
        args = config(output_dir, **trainer.TRAINING | {"bf16": False, "dataset_num_proc": None} | overrides)
        data = {"processing_class": trainer_data.tokenizer()}
        if extra.get("ref"):  # a reference model with other weights than the policy's
            data["ref_model"] = hf_models.build(name, seed=1)
        for split, (n, seed) in {"train_dataset": (48, 0), "eval_dataset": (8, 1)}.items():
            data[split] = preference_rows(kind, n, seed)
            if args.precompute_ref_log_probs:  # TRL caches the log-probs beside the dataset's files
                data[split] = on_disk(data[split], os.path.join(output_dir, split))
    elif kind in ("grpo", "rloo"):  # None: the config's default
        config = {"grpo": GRPOConfig, "rloo": RLOOConfig}[kind]
        args = config(output_dir, **{k: v for k, v in (GRPO_TRAINING | overrides).items() if v is not None})
        if extra.get("ref"):
            saved_as_reference(model, os.path.join(output_dir, "initial"))
        data = {"processing_class": trainer_data.tokenizer(), "reward_funcs": even_tokens}
        data |= {"train_dataset": prompt_rows(48, 0), "eval_dataset": prompt_rows(8, 1)}
        if extra.get("desync"):
            data["callbacks"] = [Desynced(cp_size)]
    elif kind == "reward":  # chosen / rejected completions of 2 to 30 words after a shared prompt
        args = RewardConfig(
            output_dir, **trainer.TRAINING | {"bf16": False, "dataset_num_proc": None} | overrides
        )
        data = {"processing_class": trainer_data.tokenizer()}
        for split, (n, seed) in {"train_dataset": (48, 0), "eval_dataset": (8, 1)}.items():
            prompts = trainer_data.sentences(n, 3, 6, seed)
            chosen, rejected = (trainer_data.sentences(n, 2, 30, seed + k) for k in (100, 200))
            data[split] = Dataset.from_dict(
                {"chosen": [p + " " + c for p, c in zip(prompts, chosen, strict=True)],
                 "rejected": [p + " " + r for p, r in zip(prompts, rejected, strict=True)]}
            )  # fmt: skip
    else:
        if name == "gpt_oss":  # TRL's default adds the router's loss, per rank not exact: refused
            overrides = {"router_aux_loss_coef": 0.0} | overrides
        args = sft.sft_config(output_dir, **overrides)
        if extra.get("images"):  # prompts with images, completions, padded (TRL packs no images)
            args = vlm.vlm_config(output_dir, **overrides)
            image = {
                "qwen2_vl": hf_models.QWEN_IMAGE,
                "gemma4": hf_models.GEMMA4_IMAGE,
                "glm4v": hf_models.GLM4V_IMAGE,
            }.get(name, vlm.IMAGE)
            data = dict(train_dataset=vlm.rows(48, 0, image), eval_dataset=vlm.rows(8, 1, image))
            if extra.get("one_image"):  # the rows with one image
                data = {key: rows.filter(lambda row: len(row["images"]) == 1) for key, rows in data.items()}
        elif extra.get("text"):  # language modelling on whole rows, packed
            data = dict(
                train_dataset=Dataset.from_dict({"text": trainer_data.sentences(96, 3, 20, seed=0)}),
                eval_dataset=Dataset.from_dict({"text": trainer_data.sentences(16, 3, 20, seed=1)}),
            )
        else:  # prompt-completion pairs, packed, the loss on completions only
            data = dict(train_dataset=sft.pairs(96, seed=0), eval_dataset=sft.pairs(16, seed=1))
        if extra.get("eval") == "long":  # prompts of 36 to 40 words, completions of 2 or 3, a row a batch
            prompts, completions = trainer_data.sentences(8, 36, 40, 2), trainer_data.sentences(8, 2, 3, 3)
            data["eval_dataset"] = Dataset.from_dict(
                {"prompt": prompts, "completion": [" " + c for c in completions]}
            )
        data["processing_class"] = trainer_data.tokenizer()
        if extra.get("images"):
            processor = {
                "qwen2_vl": hf_models.qwen2_vl_processor,
                "gemma4": hf_models.gemma4_processor,
                "glm4v": hf_models.glm4v_processor,
            }.get(name, vlm.processor)
            data["processing_class"] = processor()
    if wrapped_by_trl:
        data["peft_config"] = lora_config(kind)
        torch.manual_seed(0)  # as model_of draws A
    Rows.reference_passes = passes = []  # (TRL's __init__ runs the reference pass)
    built = (plain if cp_size == 1 else cp)(model=model, args=args, **data, **kwargs)
    built.rows, built.received, built.reference_passes = [], received, passes
    return built


def preference_rows(kind, n, seed):
    """DPO's chosen / rejected completions of 2 to 30 words after prompts of 3 to 6; KTO's unpaired
    completions, every third one undesirable."""
    prompts = trainer_data.sentences(n, 3, 6, seed)
    chosen, rejected = ([" " + c for c in trainer_data.sentences(n, 2, 30, seed + k)] for k in (100, 200))
    if kind == "dpo":
        return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    labels = [i % 3 != 2 for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "completion": chosen, "label": labels})


def on_disk(dataset, path):
    """`dataset` saved under `path` (by rank 0) and loaded from there: its cache files (TRL's
    precomputed reference log-probs) are then where every process reads them, not in a
    process's own temporary directory."""
    from datasets import load_from_disk

    if not dist.is_initialized() or dist.get_rank() == 0:
        dataset.save_to_disk(path)
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(path)


def initial_params(case):
    """The case's model's parameters before training (hf_models' seeded weights)."""
    kind, name, _, extra = EVERY_CASE[case]
    return {k: p.detach() for k, p in model_of(kind, name, extra).named_parameters()}


def run(name, cp_size, output_dir):
    kind, model, layout, extra = EVERY_CASE[name]
    t = build(kind, model, layout, extra, cp_size, output_dir)
    t.train()
    evaluated = untimed(t.evaluate())
    result = {"log": [untimed(h) for h in t.state.log_history if "loss" in h], "eval": evaluated}
    result["eval_loss"] = evaluated["eval_loss"]
    if kind in ("grpo", "rloo"):  # TRL's completions table, as rank 0 holds it to log
        logs = t._logs
        result["completions"] = {key: list(logs[key]) for key in ("prompt", "completion", "advantages")}
        result["completions"] |= {f"rewards/{k}": list(v) for k, v in logs["rewards"].items()}
    result["params"] = params(t.model)
    if extra.get("lora") and not extra.get("fsdp"):  # the saved adapter, loaded into the plain model
        import peft

        t.save_model(os.path.join(output_dir, "adapter"))
        if dist.is_initialized():
            dist.barrier()
        plain = peft.PeftModel.from_pretrained(model_of(kind, model, {}), os.path.join(output_dir, "adapter"))
        trained, loaded = t.model.state_dict(), plain.state_dict()
        result["adapter"] = {k: torch.equal(loaded[k], v) for k, v in trained.items() if "lora_" in k}
    result["rows"] = gathered(t.rows)
    result["reference_passes"] = gathered(t.reference_passes)
    result["received"] = gathered(sorted(t.received))
    checkpointed = [
        m._gradient_checkpointing_func
        for m in t.model.modules()
        if getattr(m, "gradient_checkpointing", 0) is True
    ]
    result["checkpointing"] = str(checkpointed[0].keywords) if checkpointed else None
    return result


def untimed(logged):
    """A logged dict without its timings (with the tokens seen, every step logs its speed)."""
    return {k: v for k, v in logged.items() if not k.endswith(("_runtime", "_per_second"))}


def params(model):
    """Every parameter, whole (FSDP2's sharded ones gathered: every rank calls this)."""
    return {k: getattr(p, "full_tensor", p.detach)().detach().clone() for k, p in model.named_parameters()}


def gathered(obj):
    """[every rank's obj] (one process: [obj])."""
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def resume(case, cp_size, output_dir):
    """The case's trainer (Gemma 3): 3 steps, a checkpoint after each; then resumed from step 2's
    to step 3. Both runs' parameters and logs, and the last checkpoint's path (the test loads it)."""
    kind, model, layout, extra = EVERY_CASE[case]
    first = build(kind, model, layout, extra, cp_size, output_dir, save_strategy="steps", save_steps=1)
    first.train()
    again = build(kind, model, layout, extra, cp_size, output_dir)
    again.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")
    return {
        "uninterrupted": params(first.model),
        "resumed": params(again.model),
        "log": [untimed(h) for h in again.state.log_history if "loss" in h],
        "uninterrupted_log": [untimed(h) for h in first.state.log_history if "loss" in h],
        "checkpoint": f"{output_dir}/checkpoint-3",
    }


class NoKwargs(tf.LlamaForCausalLM):
    """Llama whose forward takes no `**kwargs` (transformers' Trainer then passes no count)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, shift_labels=None, use_cache=None):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            shift_labels=shift_labels,
            use_cache=use_cache,
        )


def refusals(output_dir):
    """What each rank's ContextParallelMixin raised for arguments it cannot make exact."""
    world = dist.get_world_size()
    said = {}
    for what, cp_size, overrides in (
        ("cp_size", world + 1, {}),
        ("label_smoothing", world, {"label_smoothing_factor": 0.1}),
    ):
        try:
            build("trainer", "llama", "contiguous", {}, cp_size, output_dir, **overrides)
            said[what] = None
        except ValueError as e:
            said[what] = str(e)
    try:
        classes("trainer")[1](model=hf_models.build("llama"), args=trainer.training_args(output_dir),
                              compute_metrics=lambda p: {}, cp_size=world)  # fmt: skip
        said["compute_metrics"] = None
    except ValueError as e:
        said["compute_metrics"] = str(e)
    try:  # an IterableDataset under accelerate's default dispatching (rank 0 reads for every process)
        t = build(
            "trainer", "llama", "contiguous", {"iterable": True}, world, output_dir, accelerator_config={}
        )
        t.get_train_dataloader()
        said["dispatch_batches"] = None
    except ValueError as e:
        said["dispatch_batches"] = str(e)
    try:  # a sequence classification model under transformers' Trainer (RewardTrainer's loss only)
        model = hf_models.build_head("ForSequenceClassification")
        classes("trainer")[1](model=model, args=trainer.training_args(output_dir), cp_size=world)
        said["sequence_classification"] = None
    except ValueError as e:
        said["sequence_classification"] = str(e)
    try:  # a causal LM whose forward takes no **kwargs: the micro-batch's count cannot reach its loss
        model = NoKwargs(hf_models.build("llama").config)
        classes("trainer")[1](model=model, args=trainer.training_args(output_dir), cp_size=world)
        said["no_loss_kwargs"] = None
    except ValueError as e:
        said["no_loss_kwargs"] = str(e)
    for what, options in (  # TRL's default num_generations (8): batches that split over the processes only
        ("grpo_train_batch", {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}),
        ("grpo_eval_batch", {"per_device_train_batch_size": 8, "eval_strategy": "steps", "eval_steps": 1}),
    ):
        try:
            build("grpo", "llama", "contiguous", {}, world, output_dir, num_generations=8, **options)
            said[what] = None
        except ValueError as e:
            said[what] = str(e)
    try:  # GPT-OSS under SFTTrainer's default: the router's auxiliary loss
        build("sft", "gpt_oss", "contiguous", {}, world, output_dir, router_aux_loss_coef=0.001)
        said["router_aux_loss"] = None
    except ValueError as e:
        said["router_aux_loss"] = str(e)
    return said


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cp-size", type=int, required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--refusals", action="store_true")
    p.add_argument("--recipes", action="store_true", help="also the recipes trainer, sft, dpo, grpo and vlm")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    # each launch its own folders: launches run side by side (TRL caches precomputed reference
    # log-probs beside a dataset, and reads a cache it finds instead of running its pass)
    workdir = os.path.join(os.path.dirname(args.out), "runs_" + os.path.basename(args.out))
    for name in args.cases.split(",") if args.cases else ():
        results[name] = run(name, args.cp_size, os.path.join(workdir, name))
    if args.recipes:  # as docs/trainer.md runs them (float32 models), with or without CP
        for recipe in (trainer, sft, dpo, grpo, vlm):
            out = os.path.join(workdir, recipe.__name__.rsplit(".", 1)[1])
            results[recipe.__name__] = recipe.main(["--cp-size", str(args.cp_size), "--output-dir", out])
    if args.resume:
        for case in ("trainer_gemma3", "trainer_gemma3_fsdp2"):
            results[f"resume {case}"] = resume(case, args.cp_size, os.path.join(workdir, f"resume_{case}"))
    if args.refusals:
        results["refusals"] = gathered(refusals(os.path.join(workdir, "refused")))
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, args.out)
    if dist.is_initialized():
        gc.collect()  # free gloo work held in reference cycles first: avoids an abort at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
