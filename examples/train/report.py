"""Rank 0's report: bytes, memory and speed, and with --reference the comparison, verdict and figure."""

import json
import os
from pathlib import Path
import time

import torch

from cp_support import results
from cp_support.models import build_model
from examples.train.loop import train_reference

TOLERANCE = {"float64": 1e-5, "float32": 1e-4}  # examples.train's docstring, step 7


def report(args, corpus, device, losses, times, elapsed, per_rank, params, job_start):
    """Rank 0: transport bytes, memory and speed; with --reference the one-process run and the verdict."""
    peaks = [peak for peak, _ in per_rank]
    received = {t: [r[t] for _, r in per_rank] for t in per_rank[0][1]}
    tokens_per_step = args.dp * args.batch * args.seq_len
    median = sorted(times)[len(times) // 2] if times else float("nan")
    layer_types = build_model(args.model, args.seq_len, args.window, torch.float32).config.layer_types
    print_transport(received, layer_types, len(per_rank))
    print(f"\npeak resident memory per rank while training: {', '.join(f'{p:.0f}' for p in peaks)} MiB")
    print(
        f"median step {median * 1000:.0f} ms, {tokens_per_step / median:,.0f} tokens/s; {elapsed:.1f}s for "
        f"the model, the transport measurement and {len(times)} steps"
    )
    metrics = {
        "stamp": results.stamp(),
        "args": vars(args),
        "losses": losses,
        "step_seconds": times,
        "tokens_per_step": tokens_per_step,
        "peak_rss_mib": peaks,
        "received_per_layer": received,
    }
    status = 0
    if args.reference:
        rows = args.dp * args.batch
        print(
            f"\n[reference] the same model, seed and data, one process: {rows} x {args.seq_len} tokens a step"
        )
        one, one_params = train_reference(args, corpus, device, set(losses))
        tolerance = TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
        print(f"{'step':>5}{'loss (1 process)':>20}{'loss (DP x CP)':>20}{'|difference|':>15}")
        for step in sorted(losses):
            print(f"{step:>5}{one[step]:>20.9f}{losses[step]:>20.9f}{abs(one[step] - losses[step]):>15.3e}")
        worst = max(abs(one[s] - losses[s]) for s in losses)
        verdict = "EQUAL" if worst <= tolerance else "DIFFERENT"
        print(f"{verdict}: largest difference {worst:.3e} (tolerance {tolerance:g} for {args.dtype})")
        drift = max(((params[k] - p.cpu()).abs().max() / p.abs().max()).item() for k, p in one_params.items())
        print(f"trained parameters: largest difference {drift:.3e}, relative to each tensor's largest entry")
        metrics |= {"parameter_difference": drift, "tolerance": tolerance, "verdict": verdict}
        title = (
            f"{args.model}, {args.dtype}: dp {args.dp} x cp {args.cp} ({args.layout} shards), "
            f"{args.seq_len} tokens a sequence, against one process"
        )
        draw_losses(losses, one, tolerance, args.figure, title)
        print(f"figure: {args.figure}")
        metrics["reference_losses"] = one
        status = 0 if worst <= tolerance else 1
    included = ", the reference included" if args.reference else ""
    print(f"job: {time.perf_counter() - job_start:.1f}s from the start of main{included}")
    if args.metrics:
        os.makedirs(os.path.dirname(args.metrics) or ".", exist_ok=True)
        Path(args.metrics).write_text(json.dumps(metrics, indent=1))
    return status


def print_transport(report, layer_types, n):
    if not report:
        print("\nNo CP: no sequence transport")
        return
    print(
        f"\nBytes each rank receives per step (forward+backward), per layer, the largest over the {n} ranks:"
    )
    if "allgather" not in report:  # head_tail: the all-gather baseline is contiguous only
        print(f"{'layer':>5}  {'kind':<18}{'torch_impl':>14}")
        for i, kind in enumerate(layer_types):
            print(f"{i:>5}  {kind:<18}{max(r[i] for r in report['torch_impl']):>14,}")
        print(f"{'step':>5}  {'all layers':<18}{max(sum(r) for r in report['torch_impl']):>14,}")
        return
    print(f"{'layer':>5}  {'kind':<18}{'torch_impl':>14}{'all-gather K/V':>16}{'ratio':>8}")
    ours, base = (report[t] for t in ("torch_impl", "allgather"))
    for i, kind in enumerate(layer_types):
        a, b = max(r[i] for r in ours), max(r[i] for r in base)
        print(f"{i:>5}  {kind:<18}{a:>14,}{b:>16,}{a / b if b else float('nan'):>8.3f}")
    a, b = max(sum(r) for r in ours), max(sum(r) for r in base)
    print(f"{'step':>5}  {'all layers':<18}{a:>14,}{b:>16,}{a / b:>8.3f}")


def draw_losses(cp, one, tolerance, path, title):
    """The two loss curves overlaid, and their difference (steps where they are equal: x at the floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = sorted(cp)
    diff = [abs(cp[s] - one[s]) for s in steps]
    floor = min([d for d in diff if d > 0] + [tolerance]) / 10
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 2))
    top.plot(steps, [one[s] for s in steps], "-", lw=3, alpha=0.5, label="1 process")
    top.plot(steps, [cp[s] for s in steps], "--", color="k", lw=1, label="DP x CP")
    top.set_ylabel("loss")
    top.legend()
    differ = [(s, d) for s, d in zip(steps, diff, strict=True) if d]
    equal = [s for s, d in zip(steps, diff, strict=True) if not d]
    if differ:
        bottom.semilogy(*zip(*differ, strict=True), "o", ms=4, label="|difference|")
    if equal:
        bottom.semilogy(equal, [floor] * len(equal), "x", label="equal (drawn at the floor)")
    bottom.axhline(tolerance, color="r", ls="--", lw=1, label="tolerance")
    bottom.set_ylim(floor / 2, tolerance * 5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss difference|")
    top.set_title(title, fontsize=9)
    bottom.legend(fontsize=7, ncol=3, loc="upper right")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
