"""`make bench-train`: examples.train's training step with this library vs the all-gather baseline.

    python -m benchmarks.train_bench [--quick] [--reps 2] [--steps 4] [--model M] [--json FILE]

Both transports train the same model (Gemma 3's layout, window 512, examples.train's sizes) on the
same data under torchrun on this machine's gloo ranks; they differ only in how each attention
layer gets its keys and values: `torch_impl` fetches a sliding layer's W-1 preceding tokens and
gathers a global layer's whole sequence; `allgather` gathers K and V whole in every layer (as torch's
context_parallel and NeMo do) and slices the window. Configurations: CP 4 at 4096 tokens per rank
(16384 in all), and CP 2, 4, 8 at 2048 tokens per rank; then examples.train's DeepSeek V3.2
(sparse attention in every layer, the indexer's top-k = the window) at CP 4, 2048 tokens per rank,
where torch_impl moves the causal prefix's MLA latents and `allgather` all-gathers the expanded
per-head K and V (both gather the indexer's keys alike). Both use torch_impl.attention's math. The
jobs alternate (baseline, library,
baseline, library, ...) so that drift of this shared machine hits both alike.

The ranks run with make bench's environment (cp_support.launch.RANK_ENV: one thread, glibc returning freed
blocks at once, transparent huge pages). Per job, from its metrics file: the median step time after
the first step, the peak resident memory of the training steps (the largest over ranks), and the
bytes a rank receives per step through the transport (counted at the c10d calls before training,
the largest over ranks). Reported as ratios library / baseline, medians over repetitions.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from cp_support import results
from cp_support.launch import RANK_ENV

TRANSPORTS = ("allgather", "torch_impl")


def configurations(quick):
    """(model, cp, tokens per rank); the first is the headline configuration, then a CP sweep, then
    DeepSeek V3.2's sparse attention (its `--window` is the indexer's top-k)."""
    if quick:
        return [("gemma3", 2, 512)]
    gemma = [("gemma3", 4, 4096), ("gemma3", 2, 2048), ("gemma3", 4, 2048), ("gemma3", 8, 2048)]
    return gemma + [("deepseek_v32", 4, 2048)]


def run_job(model, cp, per_rank, transport, steps, window, workdir):
    metrics = os.path.join(workdir, f"{model}-{cp}-{per_rank}-{transport}-{time.monotonic_ns()}.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(cp), "-m", "examples.train"]
    command += ["--model", model, "--cp", str(cp), "--seq-len", str(cp * per_rank)]
    command += [
        "--window",
        str(window),
        "--steps",
        str(steps),
        "--transport",
        transport,
        "--metrics",
        metrics,
    ]
    env = os.environ | RANK_ENV  # as make bench: peak memory counts live tensors, not freed ones
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    m = json.loads(open(metrics).read())
    return {
        "step_ms": 1000 * statistics.median(m["step_seconds"][1:]),
        "peak_mib": max(m["peak_rss_mib"]),
        "bytes_per_step": max(sum(rank) for rank in m["received_per_layer"][transport]),
    }


def summarize(model, cp, per_rank, runs):
    row = {"model": model, "cp": cp, "tokens_per_rank": per_rank, "seq_len": cp * per_rank}
    for transport in TRANSPORTS:
        for key in ("step_ms", "peak_mib", "bytes_per_step"):
            row[f"{transport}_{key}"] = statistics.median(r[key] for r in runs[transport])
    for key in ("step_ms", "peak_mib", "bytes_per_step"):
        row[f"{key}_ratio"] = row[f"torch_impl_{key}"] / row[f"allgather_{key}"]
    return row


HEADER = (
    f"{'model':<13}{'cp':>3}{'tokens':>8}{'per rank':>9}  {'step ms':>17}{'ratio':>7}"
    f"  {'peak MiB':>13}{'ratio':>7}  {'MiB received per step':>23}{'ratio':>7}"
)


def format_row(r):
    def pair(key, scale=1.0, fmt=".0f"):
        a, b = r[f"torch_impl_{key}"] * scale, r[f"allgather_{key}"] * scale
        return f"{a:>8{fmt}} / {b:<8{fmt}}{r[f'{key}_ratio']:>7.2f}"

    return (
        f"{r['model']:<13}{r['cp']:>3}{r['seq_len']:>8}{r['tokens_per_rank']:>9}  {pair('step_ms')}"
        f"  {pair('peak_mib')}  {pair('bytes_per_step', 2**-20, '.2f')}"
    )


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gemma = [r for r in rows if r["model"] == "gemma3"]
    if not gemma:
        return
    sweep = sorted(
        (r for r in gemma if r["tokens_per_rank"] == gemma[-1]["tokens_per_rank"]), key=lambda r: r["cp"]
    )
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("step_ms", "step time"), ("peak_mib", "peak memory"), ("bytes_per_step", "bytes")):
        ax.plot([r["cp"] for r in sweep], [r[f"{key}_ratio"] for r in sweep], "o-", label=label)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xticks([r["cp"] for r in sweep])
    ax.set_xlabel(f"CP ranks ({sweep[0]['tokens_per_rank']} tokens per rank)")
    ax.set_ylabel("torch_impl / all-gather K,V")
    ax.set_ylim(bottom=0)
    ax.set_title("Gemma 3 layout (window 512): one training step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per transport (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="steps per job; the first is not timed")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--model", default=None, help="only this model's configurations (gemma3, deepseek_v32)"
    )
    parser.add_argument("--json", default="out/bench_train.json")
    parser.add_argument("--plot", default="out/bench_train.png")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 2)
    rows, started = [], time.perf_counter()
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as workdir:
        for model, cp, per_rank in configurations(args.quick):
            if args.model and model != args.model:
                continue
            runs = {t: [] for t in TRANSPORTS}
            for _ in range(reps):
                for transport in TRANSPORTS:
                    job = (model, cp, per_rank, transport, args.steps, args.window, workdir)
                    runs[transport].append(run_job(*job))
            rows.append(summarize(model, cp, per_rank, runs))
            print(format_row(rows[-1]), flush=True)
    print(f"# {time.perf_counter() - started:.0f}s in all; ratios: torch_impl / all-gather baseline")
    for path in (args.json, args.plot):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    results.write(args.json, args, rows)
    plot(rows, args.plot)
    print(f"json: {args.json}\nplot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
