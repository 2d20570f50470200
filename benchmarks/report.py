"""`make bench-report`: the figures of the README and the docs, written from the benchmarks' JSON.

    python -m benchmarks.report [--check]

Every block of README.md and docs/*.md between `<!-- generated: NAME -->` and `<!-- end generated -->`
is NAME's rendering (BLOCKS below) of the files it reads in docs/results/, which the `make bench*`
targets write (cp_support.results: rows, arguments, and the stamp naming the commit, the machine
and the command). Each block says which run it comes from. A block whose file is missing says which
target writes it. `--check` writes nothing and exits 1 if a block differs from its rendering (the
test suite runs it), so a figure in the docs is never older than the file it is generated from.
"""

import argparse
import json
from pathlib import Path
import re
import statistics
import sys
import textwrap

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def provenance(*runs):
    """A line per run: the commit, the date, the machine, the command."""
    lines = []
    for data in runs:
        s = data["stamp"]
        m = s["machine"]
        where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
        modified = " with uncommitted changes" if s["modified"] else ""
        lines.append(
            f"<sub>Measured at commit `{s['commit']}`{modified}, {s['date']}, on {where} (torch "
            f"{s['torch']}): `{s['command']}`</sub>"
        )
    return "\n\n".join(lines)


def ratio(a, b):
    return f"{a / b:.2f}x"


def mib(n):
    return f"{n / 2**20:.2f}"


# --- one rank's memory and time (benchmarks.rank_capacity) ------------------------------------------


def capacity(data):
    rows = [r for r in data["rows"] if "peak_mib" in r]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    received = any("received_per_layer" in r for r in rows)
    head = ["tokens per rank L (S = n L)", "alone: peak MiB, ms"]
    head += [f"{v}: peak, ms (x alone)" for v in variants if v != "alone"]
    head += ["received per layer"] if received else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for L in dict.fromkeys(r["L"] for r in rows):
        at = {r["variant"]: r for r in rows if r["L"] == L}
        alone = at.get("alone")
        cells = [
            f"{L} ({at[next(iter(at))]['S']})",
            f"{alone['peak_mib']:.0f}, {alone['ms']:.0f}" if alone else "",
        ]
        for v in variants:
            if v == "alone":
                continue
            r = at.get(v)
            if r is None:
                cells.append("")
            elif alone:
                cells.append(
                    f"{r['peak_mib']:.0f}, {r['ms']:.0f} ({ratio(r['peak_mib'], alone['peak_mib'])}, "
                    f"{ratio(r['ms'], alone['ms'])})"
                )
            else:
                cells.append(f"{r['peak_mib']:.0f}, {r['ms']:.0f}")
        if received:
            cells.append(f"{at['torch_impl'].get('received_per_layer', 0):,} B" if "torch_impl" in at else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capacity_block(name):
    def render(data):
        return f"{capacity(data)}\n\n{provenance(data)}"

    return ([name], render)


def compressed_capacity(data):
    """DeepSeek V4: the capacity table, then per L the bytes each layer kind received in a forward
    beside an all-gather of its keys."""
    lines = [
        "| L | layer | received in a forward | all-gather of its keys | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        for kind, got in r.get("received", {}).items():
            keys = r["allgather_keys"]
            lines.append(f"| {r['L']} | {kind} | {got:,} B | {keys:,} B | {ratio(got, keys)} |")
    return f"{capacity(data)}\n\n{chr(10).join(lines)}\n\n{provenance(data)}"


def capacity_last(data, variant):
    """(peak, ms) ratios to the rank alone at the largest L."""
    rows = [r for r in data["rows"] if "peak_mib" in r]
    L = max(r["L"] for r in rows)
    at = {r["variant"]: r for r in rows if r["L"] == L}
    return L, at[variant]["peak_mib"] / at["alone"]["peak_mib"], at[variant]["ms"] / at["alone"]["ms"]


def sinks_and_cap(gemma2, gpt_oss, gemma3):
    lines = [
        "| model (L = 4096, S = 32768) | alone: peak MiB, ms | torch_impl: peak, ms (x alone) |",
        "|---|---|---|",
    ]
    for label, data in (
        ("GPT-OSS (sinks)", gpt_oss),
        ("Gemma 2 (soft-capping)", gemma2),
        ("Gemma 3", gemma3),
    ):
        at = {r["variant"]: r for r in data["rows"] if r.get("L") == 4096 and "peak_mib" in r}
        a, t = at["alone"], at["torch_impl"]
        lines.append(
            f"| {label} | {a['peak_mib']:.0f}, {a['ms']:.0f} | {t['peak_mib']:.0f}, {t['ms']:.0f} "
            f"({ratio(t['peak_mib'], a['peak_mib'])}, {ratio(t['ms'], a['ms'])}) |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(gpt_oss, gemma2, gemma3)}"


# --- packed rows (benchmarks.packed_rows) -----------------------------------------------------------


def packed(data):
    rows = data["rows"]
    lines = [
        "| documents | layout | rank | alone: peak MiB, ms | torch_impl: peak, ms (x alone) "
        "| full layers' bytes / documents' minimum | sliding layers' |",
        "|---|---|---|---|---|---|---|",
    ]
    alone = {(r["mix"], r["layout"], r["rank"]): r for r in rows if r["variant"] == "alone"}
    for r in rows:
        if r["variant"] != "torch_impl":
            continue
        a = alone[(r["mix"], r["layout"], r["rank"])]
        kinds = [
            f"{r['bytes'].get(k, 0):,} / {r['minimum'][k]:,}" for k in ("full_attention", "sliding_attention")
        ]
        lines.append(
            f"| {r['mix']} | {r['layout']} | {r['rank']} | {a['peak_mib']:.0f}, {a['ms']:.0f} | "
            f"{r['peak_mib']:.0f}, {r['ms']:.0f} ({ratio(r['peak_mib'], a['peak_mib'])}, "
            f"{ratio(r['ms'], a['ms'])}) | {kinds[0]} | {kinds[1]} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def packed_ranks(data):
    rows = [r for r in data["rows"] if r["variant"] == "torch_impl"]
    lines = [
        "| documents | layout | slowest rank, ms | fastest, ms | mean, ms | bytes received, all ranks "
        "| every rank at the documents' minimum |",
        "|---|---|---|---|---|---|---|",
    ]
    for mix, layout in dict.fromkeys((r["mix"], r["layout"]) for r in rows):
        at = [r for r in rows if (r["mix"], r["layout"]) == (mix, layout)]
        slow, fast = max(at, key=lambda r: r["ms"]), min(at, key=lambda r: r["ms"])
        total = sum(sum(r["bytes"].values()) for r in at)
        exact = all(r["bytes"] == r["minimum"] for r in at)
        lines.append(
            f"| {mix} | {layout} | {slow['ms']:.0f} (rank {slow['rank']}) | {fast['ms']:.0f} (rank "
            f"{fast['rank']}) | {statistics.mean(r['ms'] for r in at):.0f} | {mib(total)} MiB | "
            f"{'yes' if exact else 'no'} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


# --- the transport (benchmarks.cp_bench) ---------------------------------------------------------


def bench_table(data, halo):
    rows = [r for r in data["rows"] if "variant" in r and r["world"] == 4 and r["batch"] == 1]
    L = max(r["L"] for r in rows)
    want = None if not halo else L // 4
    rows = [r for r in rows if r["L"] == L and r["halo_size"] == want]
    base = "full_then_slice" if halo else "list_cat"
    lines = [
        f"n = 4 gloo ranks, B = 1, L = {L}, D = {rows[0]['D']}, float32"
        + (f", halo_size = L/4 = {want}" if halo else "")
        + ":",
        "",
        f"| variant | fwd+bwd ms | fwd ms | peak MiB | time / {base} | memory / {base} "
        "| MiB received (minimum), largest rank | TCP MiB, largest rank | c10d calls |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recv = "" if r["recv"][0] is None else f"{mib(max(r['recv']))} ({mib(max(r['min']))})"
        lines.append(
            f"| {r['variant']} | {r['fb_ms']:.1f} | {r['fwd_ms']:.1f} | {r['peak_mib']:.0f} | "
            f"{r['time_ratio']:.2f} | {r['mem_ratio']:.2f} | {recv} | {mib(max(r['wire']))} | "
            f"{r['calls'] if r['calls'] is not None else ''} |"
        )
    return "\n".join(lines)


def bench_findings(data):
    rows = [r for r in data["rows"] if "variant" in r]
    configs = {(r["world"], r["batch"], r["L"], r["halo_size"]) for r in rows}
    halos = [r for r in rows if r["halo_size"] is not None and r["variant"] in ("torch_impl", "all_to_all")]
    exact = sum(r["recv_is_min"] for r in halos)
    by = {(r["world"], r["batch"], r["L"], r["halo_size"], r["variant"]): r for r in rows}
    gather = [by[(*c, "torch_impl")]["time_ratio"] for c in configs if c[3] is None]
    gather_fwd = [
        by[(*c, "torch_impl")]["fwd_ms"] / by[(*c, "list_cat")]["fwd_ms"] for c in configs if c[3] is None
    ]
    compiled = [
        (
            by[(*c, "compiled")]["fb_ms"] / by[(*c, "torch_impl")]["fb_ms"],
            max(by[(*c, "compiled")]["wire"]) / max(by[(*c, "all_to_all")]["wire"]),
        )
        for c in configs
        if c[3] is not None
    ]
    times, wires = zip(*compiled, strict=True)
    lines = [
        f"- {len(configs)} configurations (n = {', '.join(map(str, sorted({c[0] for c in configs})))}). "
        f"`gather_halo` received exactly the analytic minimum on every rank in {exact} of {len(halos)} halo "
        "measurements (each halo configuration through the eager p2p exchange and its `all_to_all` one).",
        f"- `gather_sequence` against list_cat: forward {min(gather_fwd):.2f}x to {max(gather_fwd):.2f}x, "
        f"forward+backward {min(gather):.2f}x to {max(gather):.2f}x.",
        f"- `gather_halo` under `torch.compile` against its eager p2p exchange: {min(times):.2f}x to "
        f"{max(times):.2f}x the time; TCP bytes {min(wires):.2f}x to {max(wires):.2f}x its eager "
        "`all_to_all`'s.",
    ]
    for r in data["rows"]:
        if "layer" in r:
            lines.append(
                f"- One Gemma 3 {r['layer']} layer made CP (n = 4), forward+backward, compiled / eager: "
                f"{r['compiled_ms']:.0f} / {r['eager_ms']:.0f} ms ({ratio(r['compiled_ms'], r['eager_ms'])})."
            )
    return "\n".join(lines)


def bench_block(data):
    return (
        f"{bench_table(data, halo=False)}\n\n{bench_table(data, halo=True)}\n\n{bench_findings(data)}\n\n"
        f"{provenance(data)}"
    )


# --- training (benchmarks.train_bench, examples.train, benchmarks.trainer_cost) ----------------------


def train(data):
    lines = [
        "| model | CP ranks | tokens (per rank) | step ms, torch_impl / all-gather | ratio "
        "| peak MiB per rank | ratio | MiB received per step | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"gemma3": "Gemma 3", "deepseek_v32": "DeepSeek V3.2"}
    for r in data["rows"]:
        pair = {
            k: (r[f"torch_impl_{k}"], r[f"allgather_{k}"], r[f"{k}_ratio"]) for k in ("step_ms", "peak_mib")
        }
        b = (r["torch_impl_bytes_per_step"], r["allgather_bytes_per_step"], r["bytes_per_step_ratio"])
        lines.append(
            f"| {names.get(r['model'], r['model'])} | {r['cp']} | {r['seq_len']} ({r['tokens_per_rank']}) | "
            f"{pair['step_ms'][0]:.0f} / {pair['step_ms'][1]:.0f} | {pair['step_ms'][2]:.2f} | "
            f"{pair['peak_mib'][0]:.0f} / {pair['peak_mib'][1]:.0f} | {pair['peak_mib'][2]:.2f} | "
            f"{mib(b[0])} / {mib(b[1])} | {b[2]:.2f} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def layer_bytes(per_rank, i):
    return max(r[i] if isinstance(r, list) else r[str(i)] for r in per_rank)


def demo(data):
    a = data["args"]
    received = data["received_per_layer"]
    layers = len(received["torch_impl"][0])
    lines = [
        f"{a['model']}, {a['dtype']}: dp {a['dp']} x cp {a['cp']}, {a['seq_len']} tokens a sequence, "
        f"{len(data['losses'])} steps, against one process.",
        "",
        "| layer | bytes received per step, largest rank: torch_impl | all-gather K/V | ratio |",
        "|---|---|---|---|",
    ]
    totals = [0, 0]
    for i in range(layers):
        ours, base = layer_bytes(received["torch_impl"], i), layer_bytes(received["allgather"], i)
        totals = [totals[0] + ours, totals[1] + base]
        lines.append(f"| {i} | {ours:,} | {base:,} | {ours / base:.3f} |")
    lines.append(f"| all | {totals[0]:,} | {totals[1]:,} | {totals[0] / totals[1]:.3f} |")
    one, cp = data["reference_losses"], data["losses"]
    steps = sorted(cp, key=int)
    worst = max(abs(one[s] - cp[s]) for s in steps)
    median = statistics.median(data["step_seconds"])
    shown = steps if len(steps) <= 5 else steps[:3] + [None] + steps[-2:]
    lines += ["", "| step | loss, one process | loss, DP x CP | difference |", "|---|---|---|---|"]
    for s in shown:
        if s is None:
            lines.append("| ... | | | |")
        else:
            lines.append(f"| {s} | {one[s]:.9f} | {cp[s]:.9f} | {abs(one[s] - cp[s]):.3e} |")
    lines += [
        "",
        f"**{data['verdict']}**: largest difference {worst:.3e} (tolerance {data['tolerance']:g} for "
        f"{a['dtype']}); trained parameters {data['parameter_difference']:.3e} apart, relative to each "
        f"tensor's largest entry. Peak resident memory per rank while training: "
        f"{', '.join(f'{p:.0f}' for p in data['peak_rss_mib'])} MiB; median step {median * 1000:.0f} ms.",
        "",
        provenance(data),
    ]
    return "\n".join(lines)


def trainer_cost(data):
    names = {
        "trainer": "Trainer, padded rows of {h} to {s}",
        "sft": "SFTTrainer, packed to {s}",
        "fsdp2_lora": "Trainer under FSDP2 with LoRA (r 16 on q, k, v, o), padded rows of {h} to {s}",
    }
    s = data["args"]["seq_len"]
    lines = [
        "| case | without CP: step ms, peak MiB | CP 2: step ms, peak MiB per rank (x without) |",
        "|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in data["rows"]):
        one, two = (next(r for r in data["rows"] if r["case"] == case and r["cp"] == cp) for cp in (1, 2))
        ratios = f"{ratio(two['ms'], one['ms'])}, {ratio(two['peak_mib'], one['peak_mib'])}"
        lines.append(
            f"| {names[case].format(h=s // 2, s=s)} | {one['ms']:.0f}, {one['peak_mib']:.0f} | "
            f"{two['ms']:.0f}, {two['peak_mib']:.0f} ({ratios}) |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def dpo_cost(data):
    lines = [
        "| tokens per rank L (S = 8 L) | alone: peak MiB, ms | torch_impl: peak MiB, ms (x alone) "
        "| all-gathered MiB (calls) | all-reduced bytes (calls) | received in all |",
        "|---|---|---|---|---|---|",
    ]
    for L in sorted({r["L"] for r in data["rows"]}):
        alone, cp = (
            next(r for r in data["rows"] if (r["L"], r["variant"]) == (L, v)) for v in ("alone", "torch_impl")
        )
        lines.append(
            f"| {L} ({8 * L}) | {alone['peak_mib']:.0f}, {alone['ms']:.0f} "
            f"| {cp['peak_mib']:.0f}, {cp['ms']:.0f} "
            f"({ratio(cp['peak_mib'], alone['peak_mib'])}, {ratio(cp['ms'], alone['ms'])}) | "
            f"{mib(cp['allgather_bytes'])} ({cp['allgather_calls']}) | "
            f"{cp['allreduce_bytes']} ({cp['allreduce_calls']}) | {mib(cp['received_bytes'])} MiB |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


# --- the adapter's costs (benchmarks.layout_balance, inputs_check, dsa_bytes) -----------------------


def layout_balance(data):
    rows = data["rows"]
    names = {
        "llama": "Llama, 4 full-attention layers",
        "gemma3": "the demo's Gemma 3 layout (5 sliding of window 512, 1 global)",
    }
    lines = [
        f"| model | layout | ms per rank 0 .. {data['args']['n'] - 1} | slowest / fastest "
        "| slowest / contiguous's slowest |",
        "|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        base = max(r["ms"] for r in rows if (r["model"], r["layout"]) == (model, "contiguous"))
        for layout in dict.fromkeys(r["layout"] for r in rows):
            ms = [
                r["ms"]
                for r in sorted(rows, key=lambda r: r["rank"])
                if (r["model"], r["layout"]) == (model, layout)
            ]
            label = names.get(model, model) if layout == "contiguous" else ""
            lines.append(
                f"| {label} | {layout} | {', '.join(f'{m:.0f}' for m in ms)} | {max(ms) / min(ms):.2f} | "
                f"{max(ms) / base:.2f} |"
            )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def inputs_check(data):
    (r,) = data["rows"]
    a = data["args"]
    return (
        f"Gemma 3's layout, {a['seq_len']} tokens over {a['cp']} gloo ranks, float32 forward, medians: "
        f"the check's all-gather alone {r['check_ms']:.1f} ms, {r['check_ms'] / r['without_ms']:.1%} of a "
        f"forward ({r['without_ms']:.0f} ms); one forward with it "
        f"{ratio(r['with_check_ms'], r['without_ms'])} one without.\n\n{provenance(data)}"
    )


def dsa_bytes(data):
    a = data["args"]
    rows = {(r["model"], r["ranks"]): r for r in data["rows"]}
    lines = [
        f"n = {a['n']}, L = {a['local_len']} ({a['n'] * a['local_len']} tokens), {a['item']} bytes a value, "
        "per layer and step:",
        "",
        "| model | rank n-1: torch_impl | all-gather K/V | ratio | all ranks: ratio |",
        "|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(m for m, _ in rows):
        last, every = rows[(model, "largest")], rows[(model, "all ranks")]
        lines.append(
            f"| {model} | {last['torch_impl'] / 1e6:,.0f} MB | {last['allgather'] / 1e9:,.1f} GB | "
            f"{last['torch_impl'] / last['allgather']:.4f} | {every['torch_impl'] / every['allgather']:.4f} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def media_cost(data):
    a = data["args"]
    lines = [
        f"{a['images']} images of {a['side']} x {a['side']} pixels in a batch, Qwen2-VL's tower "
        "(depth 4, 128 wide), one thread each:",
        "",
        "| n | the last rank's images | its tower time / one process's "
        "| feature rows it receives / the batch's |",
        "|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['n']} | {r['images']} | {r['time_ratio']:.2f} (1/n = {1 / r['n']:.2f}) | "
            f"{r['received_rows']} / {r['feature_rows']} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def media_memory(data):
    a, rows = data["args"], data["rows"]
    alone = next(r for r in rows if r["variant"] == "alone")
    lines = [
        f"Gemma 3 with images of 64 tokens every {a['len'] // 8} tokens, one across each shard edge; "
        f"L = {a['len']} tokens a rank, {a['n']} gloo ranks, one thread each:",
        "",
        "| variant | rank | peak MiB | x alone | step ms | x alone |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['rank']} | {r['peak_mib']:.0f} | {r['peak_mib'] / alone['peak_mib']:.2f} "
            f"| {r['ms']:.0f} | {r['ms'] / alone['ms']:.2f} |"
        )
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


def dsa_coverage(data):
    lines = [
        "| S | n | index_topk | share of the earlier tokens selected: least | median |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(f"| {r['S']} | {r['n']} | {r['topk']} | {r['min']:.1%} | {r['median']:.1%} |")
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"


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


def render(name):
    files, fn = BLOCKS[name]
    data = [load(f) for f in files]
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
    args = p.parse_args(argv)
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
