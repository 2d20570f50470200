"""`make bench-report`: the figures of the README and the docs, written from the benchmarks' JSON.

    python -m benchmarks.report [--check] [--show NAME [--results DIR]]

Every block of README.md and docs/*.md between `<!-- generated: NAME -->` and `<!-- end generated -->`
is NAME's rendering (BLOCKS below) of the files it reads in docs/results/, which the `make bench*`
targets write (cp_support.results: rows, arguments, and the stamp naming the commit, the machine
and the command). Each block says which run it comes from. A block whose file is missing says which
target writes it. `--check` writes nothing and exits 1 if a block differs from its rendering, a
results file feeds no block or a block is shown nowhere (the test suite runs it), so a figure in the
docs is never older than the file it is generated from. `--show NAME` prints NAME's rendering of
the files in `--results` (docs/results/ by default).
"""

import argparse
import json
from pathlib import Path
import re
import sys
import textwrap

from benchmarks.report_costs import (
    demo,
    dpo_cost,
    dsa_bytes,
    dsa_coverage,
    inputs_check,
    layout_balance,
    media_cost,
    media_memory,
    train,
    trainer_cost,
)
from benchmarks.report_memory import (
    bench_block,
    capacity_block,
    capacity_last,
    compressed_capacity,
    packed,
    packed_ranks,
    sinks_and_cap,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(name, results=RESULTS):
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# --- the README's headline ---------------------------------------------------------------------------


def model_counts():
    """{verdict: families} from docs/models.md's first table (written by `make models`)."""
    text = (ROOT / "docs" / "models.md").read_text()
    rows = re.findall(r"^\| (exact|refused|skipped|wrong|crashed) \| (\d+) \|$", text, re.M)
    version = re.search(r"on transformers (\d+\.\d+)", text)[1]
    counts = {}
    for v, n in rows:  # the first table's; the image-text-to-text sweep's follows it
        counts.setdefault(v, int(n))
    return counts, version


def headline(gemma3, qwen3_5, mamba2, train_data):
    counts, version = model_counts()
    wrong = counts.get("wrong", 0) + counts.get("crashed", 0)
    L, g, _ = capacity_last(gemma3, "torch_impl")
    _, q, _ = capacity_last(qwen3_5, "torch_impl")
    _, m, _ = capacity_last(mamba2, "torch_impl")
    rows = [r for r in train_data["rows"] if r["model"] == "gemma3"]
    b = [r["bytes_per_step_ratio"] for r in rows]
    t = [r["step_ms_ratio"] for r in rows]
    items = [
        f"**Exact**: {counts['exact']} of the {sum(counts.values())} causal-LM families of transformers "
        f"{version} equal one process under CP, {counts['refused']} are refused with the reason, "
        f"{wrong or 'none'} {'is' if wrong < 2 else 'are'} wrong "
        "([docs/models.md](docs/models.md), `make models`).",
        f"**Memory**: at {L} tokens on rank 7 of 8, a Gemma 3 rank needs {g:.2f}x the memory of its own "
        f"tokens alone, Qwen3.5's Gated DeltaNet {q:.2f}x, Mamba2 {m:.2f}x "
        "([docs/benchmarks.md](docs/benchmarks.md#one-ranks-memory-and-time-make-bench-capacity)).",
        f"**Bytes**: a Gemma 3 training step receives {min(b):.2f}x to {max(b):.2f}x what an all-gather of K "
        f"and V receives, in {min(t):.2f}x to {max(t):.2f}x the step time "
        "([docs/benchmarks.md](docs/benchmarks.md#training-make-bench-train)).",
    ]
    return "\n".join(
        textwrap.fill(item, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
        for item in items
    )


# name -> (the results it reads, how it renders them)
BLOCKS = {
    "headline": (["rank_capacity", "rank_capacity_qwen3_5", "rank_capacity_mamba2", "bench_train"], headline),
    "capacity": capacity_block("rank_capacity"),
    "capacity_dsa": capacity_block("rank_capacity_dsa"),
    "capacity_qwen3_5": capacity_block("rank_capacity_qwen3_5"),
    "capacity_mamba2": capacity_block("rank_capacity_mamba2"),
    "capacity_minimax": capacity_block("rank_capacity_minimax"),
    "capacity_deepseek_v4": (["rank_capacity_deepseek_v4"], compressed_capacity),
    "capacity_sinks_cap": (["rank_capacity_gemma2", "rank_capacity_gpt_oss", "rank_capacity"], sinks_and_cap),
    "packed": (["packed_rows"], packed),
    "packed_ranks": (["packed_ranks"], packed_ranks),
    "bench": (["bench"], bench_block),
    "train": (["bench_train"], train),
    "demo": (["demo"], demo),
    "trainer_cost": (["trainer_cost"], trainer_cost),
    "dpo_cost": (["dpo_cost"], dpo_cost),
    "grpo_cost": (["grpo_cost"], dpo_cost),  # the same table
    "layout_balance": (["layout_balance"], layout_balance),
    "inputs_check": (["inputs_check"], inputs_check),
    "dsa_bytes": (["dsa_bytes"], dsa_bytes),
    "dsa_coverage": (["dsa_coverage"], dsa_coverage),
    "media_cost": (["media_cost"], media_cost),
    "media_memory": (["media_memory"], media_memory),
}

# which make target writes each results file
TARGETS = {
    "bench": "make bench",
    "bench_train": "make bench-train",
    "packed_rows": "make bench-packed",
    "packed_ranks": "make bench-packed",
    **{
        f"rank_capacity{s}": "make bench-capacity"
        for s in ("", "_dsa", "_qwen3_5", "_mamba2", "_minimax", "_gemma2", "_gpt_oss", "_deepseek_v4")
    },
    **{
        n: "make bench-other"
        for n in (
            "demo",
            "trainer_cost",
            "dpo_cost",
            "grpo_cost",
            "layout_balance",
            "inputs_check",
            "dsa_bytes",
            "dsa_coverage",
            "media_cost",
            "media_memory",
        )
    },
}


def render(name, results=RESULTS):
    files, fn = BLOCKS[name]
    data = [load(f, results) for f in files]
    missing = [f for f, d in zip(files, data, strict=True) if d is None]
    if missing:
        targets = dict.fromkeys(TARGETS[f] for f in missing)
        how = " and ".join(f"`{t}`" for t in targets) + (" writes " if len(targets) == 1 else " write ")
        return f"*Not measured yet: {how}" + ", ".join(f"`docs/results/{f}.json`" for f in missing) + ".*\n"
    return fn(*data).rstrip("\n") + "\n"


def rewrite(text):
    def block(match):
        head, name, _, tail = match.groups()
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {sorted(BLOCKS)}")
        return head + render(name) + tail

    return BLOCK.sub(block, text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block is out of date")
    p.add_argument("--show", choices=sorted(BLOCKS), help="print this block's rendering and stop")
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON files --show renders")
    args = p.parse_args(argv)
    if args.results != RESULTS and not args.show:
        p.error("--results is read by --show only")
    if args.show:
        print(render(args.show, args.results), end="")
        return 0
    read = {name for files, _ in BLOCKS.values() for name in files}
    unread = sorted({path.stem for path in RESULTS.glob("*.json")} - read)
    shown = {match[1] for path in documents() for match in BLOCK.findall(path.read_text())}
    unshown = sorted(set(BLOCKS) - shown)
    if unread or unshown:
        print(f"results files no block reads: {unread}; blocks no page shows: {unshown}")
        if args.check:
            return 1
    stale = []
    for path in documents():
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every generated block is up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
