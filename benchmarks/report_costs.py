"""benchmarks.report's renderings of training and the adapter's costs (the blocks `train`, `demo`,
`trainer_cost`, `dpo_cost`, `grpo_cost`, `layout_balance`, `inputs_check`, `dsa_*`, `media_*`)."""

import statistics

from benchmarks.report_memory import mib, provenance, ratio

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


# benchmarks.media_memory's models and their media
MEDIA = {
    "gemma3": "Gemma 3 with images of 64 tokens",
    "gemma4": "Gemma 4 with images of 64 tokens (bidirectional on its sliding layers only)",
    "qwen3_vl": "Qwen3-VL with a video, a frame of 64 tokens",
}


def media_memory(data):
    a = data["args"]
    models = {}
    for r in data["rows"]:  # (rows written before `--model` name none: Gemma 3's)
        models.setdefault(r.get("model", "gemma3"), []).append(r)
    blocks = []
    for model, rows in models.items():
        every = rows[0].get("every", a["len"] // 8)  # (files written before it: L / 8)
        lines = [
            f"{MEDIA[model]} every {every} tokens, one across each shard edge; "
            f"L = {a['len']} tokens a rank, {a['n']} gloo ranks ({a.get('layout', 'contiguous')}), "
            "one thread each:",
            "",
            "| variant | rank | peak MiB | x alone | step ms | x alone |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:  # against the rank alone on the same kind of row (with media, or text only)
            text = r["variant"].endswith(", text")
            alone = next(x for x in rows if x["variant"] == "alone" + (", text" if text else ""))
            lines.append(
                f"| {r['variant']} | {r['rank']} | {r['peak_mib']:.0f} | "
                f"{r['peak_mib'] / alone['peak_mib']:.2f} | {r['ms']:.0f} | {r['ms'] / alone['ms']:.2f} |"
            )
        blocks.append(chr(10).join(lines))
    return f"{(chr(10) * 2).join(blocks)}\n\n{provenance(data)}"


def dsa_coverage(data):
    lines = [
        "| S | n | index_topk | share of the earlier tokens selected: least | median |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(f"| {r['S']} | {r['n']} | {r['topk']} | {r['min']:.1%} | {r['median']:.1%} |")
    return f"{chr(10).join(lines)}\n\n{provenance(data)}"
