"""What `hf.ContextParallelMixin` costs: the same Trainer / SFTTrainer with CP (2 ranks, cp 2) and
without (1 process), side by side, per rank: the median step time and the peak resident set.

    python -m benchmarks.trainer_cost [--seq-len 4096] [--steps 5] [--json out/trainer_cost.json]

Cases: `trainer`, the Trainer recipe's setup (examples/recipes/trainer.py: padded rows, SGD,
gradient accumulation 2) on rows of seq-len/2 to seq-len tokens; `sft`, the SFTTrainer recipe's
(packed prompt-completion pairs, the loss on completions) packed to seq-len; `fsdp2_lora`, the
Trainer case with PEFT LoRA (r 16 on the attention's projections) under FSDP2 (accelerate's, over
every process; forced on CPU as the tests force it: cp_support.trainers.FSDP2OnCPU). The
model: Gemma 3 at hidden 256 (4 heads of 64, one KV head), 6 layers in its 5:1 sliding (window 512)
/ global layout, float32. Each run is one torchrun launch, the two variants alternating per case
(drift on this noisy machine hits both); every rank uses one thread (OMP_NUM_THREADS=1), so the
2-rank CP run uses the machine's two cores and the 1-process run one. Step time: the median over
steps 2 .. N of each rank, the slowest rank reported; peak: the resident set's rise over its value
after step 1 (glibc returning freed blocks at once: cp_support.launch.RANK_ENV), the largest rank.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from cp_support import results

CASES = ("trainer", "sft", "fsdp2_lora")


def model(seq_len):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=512,
        max_position_embeddings=2 * seq_len,
    )
    return tf.Gemma3ForCausalLM(config)


def child(args):
    """One run under torchrun: prints one JSON line per rank."""
    import transformers as tf

    from cp_support.memory import peak_mib, reset_peak
    from examples.recipes import sft, trainer, trainer_data

    class Clock(tf.TrainerCallback):
        def __init__(self):
            self.times, self.base = [], None

        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            self.times.append(time.perf_counter() - self.began)
            if state.global_step == 1:
                self.base = reset_peak()

    torch.set_num_threads(1)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size}
    clock = Clock()
    overrides = {"max_steps": args.steps}
    with tempfile.TemporaryDirectory() as out:
        if args.case in ("trainer", "fsdp2_lora"):
            classes = (tf.Trainer, trainer.CPTrainer)
            net = model(args.seq_len)
            if args.case == "fsdp2_lora":
                import peft

                from cp_support.trainers import FSDP2, LORA_TARGETS, FSDP2OnCPU

                classes = tuple(type("FSDP2" + c.__name__, (FSDP2OnCPU, c), {}) for c in classes)
                lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0)
                net, overrides = peft.get_peft_model(net, lora), overrides | FSDP2
            built = classes[args.cp_size > 1](
                model=net,
                args=trainer.training_args(out, **overrides),
                train_dataset=trainer_data.token_rows(
                    8 * args.steps, args.seq_len // 2, args.seq_len, seed=0
                ),
                data_collator=trainer_data.pad_rows,
                callbacks=[clock],
                **cp,
            )
        else:
            built = (sft.SFTTrainer if args.cp_size == 1 else sft.CPSFTTrainer)(
                model=model(args.seq_len),
                args=sft.sft_config(out, max_length=args.seq_len, **overrides),
                train_dataset=sft.pairs(args.seq_len // 3 * args.steps, seed=0),
                processing_class=trainer_data.tokenizer(),
                callbacks=[clock],
                **cp,
            )
        built.train()
    rank = int(os.environ.get("RANK", 0))
    row = {
        "case": args.case,
        "cp": args.cp_size,
        "rank": rank,
        "ms": 1000 * statistics.median(clock.times[1:]),
    }
    print(json.dumps(row | {"peak_mib": peak_mib() - clock.base}), flush=True)
    trainer.finish()


def run(case, cp, args):
    from cp_support.launch import RANK_ENV

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(max(cp, 1)), "-m", "benchmarks.trainer_cost"]
    command += ["--child", "--case", case, "--cp-size", str(cp), "--seq-len", str(args.seq_len)]
    command += ["--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=os.environ | RANK_ENV)
    if done.returncode:
        raise RuntimeError(f"{case} cp {cp} failed:\n{done.stdout[-3000:]}")
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"case"')]
    return {
        "case": case,
        "cp": cp,
        "ms": max(r["ms"] for r in ranks),
        "peak_mib": max(r["peak_mib"] for r in ranks),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json", default="out/trainer_cost.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--cp-size", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    for case in args.cases.split(","):
        for cp in (1, 2):
            rows.append(run(case, cp, args))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "| case (tokens per sequence) | without CP: step ms, peak MiB "
        "| CP 2: step ms, peak MiB per rank (x without) |"
    )
    print("|---|---|---|")
    for case in args.cases.split(","):
        one, two = (next(r for r in rows if r["case"] == case and r["cp"] == cp) for cp in (1, 2))
        ratios = f"{two['ms'] / one['ms']:.2f}x, {two['peak_mib'] / one['peak_mib']:.2f}x"
        print(
            f"| {case} ({args.seq_len}) | {one['ms']:.0f}, {one['peak_mib']:.0f} | {two['ms']:.0f}, "
            f"{two['peak_mib']:.0f} ({ratios}) |"
        )
    results.write(args.json, args, rows)
    return rows


if __name__ == "__main__":
    main()
