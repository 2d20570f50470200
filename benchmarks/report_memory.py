"""benchmarks.report's renderings of one rank's memory and time, packed rows and the transport
(the blocks `capacity*`, `packed*`, `bench`), and the helpers every rendering shares."""

import statistics


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
