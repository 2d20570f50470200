"""What a DPO step costs one CP rank: TRL's DPOTrainer with `hf.ContextParallelMixin` on rank 7 of 8
(torch's fake process group) against the plain DPOTrainer on the rank's own tokens.

    python -m benchmarks.dpo_cost [--lens 1024,4096] [--reps 3] [--json docs/results/dpo_cost.json]

A step: the trainer's `compute_loss` on one preference pair (chosen and rejected rows, the last
7/8 of each the completion), then backward: TRL's own loss on whole rows, the policy's rows sharded
and its fused LM head's per-token outputs gathered back over the row (torch_impl.hf.whole_rows),
the frozen reference model the same way, the sigmoid loss and every metric TRL logs. Variants,
per tokens-per-rank L:

  alone       the plain DPOTrainer on rows of L tokens: what the rank's own tokens cost
  torch_impl  the mixin's DPOTrainer, cp 8, as rank 7 of rows of 8 L tokens (every buffer and
              kernel real; the fake group moves no data)

The model: Gemma 3's text model with 6 sliding-window layers (window 512, so that rank 7's
attention reads as many keys as the rank alone's: a global layer's 8x keys would be measured by
`make bench-capacity`, not here), hidden 256 (4 heads of 64, one KV head), vocabulary 256,
float32, activation checkpointing (DPOConfig's default). Each (variant, L) in a fresh process:
the peak resident set above the resident set after a warm-up step (glibc returning freed blocks at
once: cp_support.launch.RANK_ENV), and the median time of `--reps` steps. One more step is counted
(cp_support.traffic): the bytes of the all-gathers (the per-token outputs, B x S x itemsize each,
and the metrics' gathers), of the all-reduces, and of every collective.
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
import torch.distributed as dist

from cp_support import results
from cp_support.memory import peak_mib, reset_peak
from cp_support.traffic import PayloadCounter

VARIANTS = ("alone", "torch_impl")
GATHERS = ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_", "all_gather_into_tensor")
N = 8
VOCAB = 256


def model(max_positions):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention"] * 6,
        sliding_window=512,
        max_position_embeddings=max_positions,
    )
    return tf.Gemma3ForCausalLM(config)


def as_rank_7(variant):
    """The trainer's cp arguments: none alone; else cp 8, this process rank 7 of a fake group."""
    if variant == "alone":
        return {}
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = str(N - 1)
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(N), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group("fake", store=FakeStore(), rank=N - 1, world_size=N)
    return {"cp_size": N}


def trainer(variant, L, out):
    """The DPOTrainer (or the mixin's, cp 8 as rank 7 of the fake group) and a pair of rows."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from examples.recipes import trainer_data
    from torch_impl import hf

    S = L if variant == "alone" else N * L
    cp = as_rank_7(variant)
    classes = (DPOTrainer, type("CPDPOTrainer", (hf.ContextParallelMixin, DPOTrainer), {}))
    pairs = Dataset.from_dict({"prompt": ["a b"], "chosen": [" c"], "rejected": [" d"]})  # TRL wants one
    args = DPOConfig(out, bf16=False, use_cpu=True, report_to=[], dataset_num_proc=None, max_length=None)
    t = classes[variant != "alone"](
        model=model(S), ref_model=model(S), args=args, train_dataset=pairs,
        processing_class=trainer_data.tokenizer(), **cp,
    )  # fmt: skip
    t.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=t.args.gradient_checkpointing_kwargs
    )
    t.model.train()
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(0))
    completion = (torch.arange(S) >= S // 8).long().expand(2, S)
    return t, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}


def child(args, build=trainer):
    """One (variant, L) in this fresh process, the trainer and batch from `build`: prints its JSON
    line."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        t, batch = build(args.child, args.child_len, out)

        def step():
            t.compute_loss(t.model, dict(batch)).backward()

        step()  # warm-up: allocates the gradients
        base = reset_peak()
        times = []
        for _ in range(args.reps):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        row = {"peak_mib": peak_mib() - base, "ms": 1000 * statistics.median(times)}
        if args.child != "alone":
            with PayloadCounter() as counter:
                step()
            reduced = [c for c in counter.log if c.op == "allreduce_"]
            row |= {"allreduce_bytes": sum(c.received for c in reduced), "allreduce_calls": len(reduced)}
            gathered = [c for c in counter.log if c.op in GATHERS]
            row |= {"allgather_bytes": sum(c.received for c in gathered), "allgather_calls": len(gathered)}
            row["received_bytes"] = counter.received
    print(json.dumps(row))


def run(args, module="benchmarks.dpo_cost"):
    """Each (L, variant) in a fresh process of `module` (its --child): the rows."""
    from cp_support.launch import RANK_ENV

    rows = []
    for L in args.lens:
        for variant in VARIANTS:
            command = [sys.executable, "-m", module, "--child", variant, "--child-len", str(L)]
            command += ["--reps", str(args.reps)]
            env = os.environ | RANK_ENV
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
            if done.returncode:
                raise RuntimeError(f"{variant} L={L} failed:\n{done.stderr[-3000:]}")
            row = {"variant": variant, "L": L} | json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def parser(doc, json_path):
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--lens", default="1024,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=json_path)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--child-len", type=int, help=argparse.SUPPRESS)
    return p


def main(argv=None, doc=__doc__, name="dpo_cost", build=trainer):
    """The benchmark `name` (this one, or benchmarks.grpo_cost with its trainer `build`): each
    (variant, L) in a child process, the rows written as JSON and printed as the docs' table."""
    args = parser(doc, f"out/{name}.json").parse_args(argv)
    if args.child:
        return child(args, build)
    args.lens = [int(x) for x in args.lens.split(",")]
    rows = run(args, f"benchmarks.{name}")
    results.write(args.json, args, rows)
    from benchmarks import report

    with open(args.json) as f:
        print(report.dpo_cost(json.load(f)))
    return rows


if __name__ == "__main__":
    main()
