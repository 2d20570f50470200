"""make bench's report: the table's rows, the figure, the targets (as data) and the compile ratios."""

HEADER = (
    f"{'world':>5} {'B':>2} {'L':>6} {'halo':>6} {'variant':<16}{'fb ms':>9}{'fwd ms':>9}{'peak MiB':>10}"
    f"{'t/base':>8}{'m/base':>8}{'recv MiB max':>13}{'=min':>6}{'wire MiB':>10}{'calls':>6}"
)


def format_row(r):
    halo = "-" if r.get("halo_size") is None else str(r["halo_size"])
    counted = r["recv_is_min"] is not None  # a compiled variant's calls are not counted, its TCP bytes are
    recv = f"{max(r['recv']) / 2**20:.2f}" if counted else "-"
    equal = ("yes" if r["recv_is_min"] else "no") if counted else "-"
    return (
        f"{r['world']:>5} {r['batch']:>2} {r['L']:>6} {halo:>6} {r['variant']:<16}{r['fb_ms']:>9.1f}"
        f"{r['fwd_ms']:>9.1f}{r['peak_mib']:>10.1f}{r['time_ratio']:>8.2f}{r['mem_ratio']:>8.2f}"
        f"{recv:>13}{equal:>6}{max(r['wire']) / 2**20:>10.2f}{r['calls'] or '-':>6}"
    )


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, label in ((axes[0], "time_ratio", "time"), (axes[1], "mem_ratio", "peak memory")):
        for world in sorted({r["world"] for r in rows}):
            for L in sorted({r["L"] for r in rows if r["world"] == world}):
                pts = sorted(
                    (r["halo_size"] / r["L"], r[metric])
                    for r in rows
                    if r["variant"] == "torch_impl"
                    and r.get("halo_size") is not None
                    and r["world"] == world
                    and r["L"] == L
                    and r["batch"] == 1
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"n={world}, L={L}")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("halo_size / L")
        ax.set_ylabel(f"{label} / full_then_slice")
        ax.set_title(f"gather_halo {label}, forward+backward")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    ax = axes[2]
    seq = [r for r in rows if r["halo_size"] is None and r["batch"] == 1]
    small = min(r["L"] for r in seq)
    for i, variant in enumerate(("torch_impl", "funcol", "dtensor", "raw")):
        color = f"C{i}"
        for metric, style in (("time_ratio", "-o"), ("mem_ratio", "--s")):
            pts = sorted((r["world"], r[metric]) for r in seq if r["variant"] == variant and r["L"] == small)
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), style, color=color, label=f"{variant} {metric.split('_')[0]}"
                )
            big = [(r["world"], r[metric]) for r in seq if r["variant"] == variant and r["L"] > small]
            if big:
                ax.plot(*zip(*big, strict=True), "*", color=color, markersize=12)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xlabel(f"world size (lines: L={small}; stars: larger L)")
    ax.set_ylabel("ratio to list_cat")
    ax.set_title("gather_sequence, forward+backward")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# The targets, at n=4, B=1, L=16384, D=512, float32, forward+backward (where that was measured):
# (what, the torch_impl row's halo_size, its measure: a field of its row, or (field, variant, ...):
# the field against that of the first variant's row, and shown against each; at most, against what)
TARGETS = (
    ("gather_sequence time", None, "time_ratio", 0.8, "list_cat"),
    ("gather_sequence peak memory", None, "mem_ratio", 0.8, "list_cat"),
    ("gather_sequence forward", None, ("fwd_ms", "raw", "raw_alloc"), 1.1, "raw all_gather_single"),
    ("gather_halo(L/4) time", 4096, "time_ratio", 0.2, "full_then_slice"),
    ("gather_halo(L/4) peak memory", 4096, "mem_ratio", 0.25, "full_then_slice"),
)
TARGET_SHAPE = {"world": 4, "batch": 1, "L": 16384}


def print_targets(rows):
    """Each of TARGETS met or missed, where its configuration was measured; and always, that every
    rank received exactly the analytic minimum for every halo_size."""

    def row(variant, halo_size):
        want = TARGET_SHAPE | {"halo_size": halo_size, "variant": variant}
        return next((r for r in rows if all(r[k] == v for k, v in want.items())), None)

    halo_rows = [r for r in rows if r["variant"] == "torch_impl" and r["halo_size"] is not None]
    checks = [
        (
            "bytes received == analytic minimum, every rank, every halo_size",
            all(r["recv_is_min"] for r in halo_rows),
            "",
        )
    ]
    for what, halo_size, measure, limit, against in TARGETS:
        ours = row("torch_impl", halo_size)
        if ours is None:
            continue
        if isinstance(measure, tuple):  # a field against the same field of other variants' rows
            field, *variants = measure
            ratios = [ours[field] / row(v, halo_size)[field] for v in variants]
            value, figure = (
                ratios[0],
                "; ".join(f"{x:.2f}x {v}" for x, v in zip(ratios, variants, strict=True)),
            )
        else:
            value = ours[measure]
            figure = f"{value:.2f}x"
        checks.append((f"{what} <= {limit:g}x {against}", value <= limit, figure))
    print("# targets (n=4, B=1, L=16384, D=512, float32, forward+backward)")
    for name, met, figure in checks:
        print(f"#   {'met   ' if met else 'MISSED'} {name}  {figure}")


def print_compile(rows):
    """gather_halo's all_to_all exchange run eagerly and under torch.compile(fullgraph=True,
    inductor), as ratios to the eager p2p exchange of the same configuration in the same run."""
    print("# torch.compile: gather_halo forward+backward, ratios to eager gather_halo (p2p)")
    print(f"# {'world':>5} {'L':>6} {'halo':>6}{'all_to_all time':>17}{'compiled time':>15}{'TCP bytes':>11}")
    for r in rows:
        if r["variant"] != "compiled":
            continue
        same = {k: r[k] for k in ("world", "batch", "L", "halo_size")}
        eager, a2a = (
            next(x for x in rows if x["variant"] == v and all(x[k] == same[k] for k in same))
            for v in ("torch_impl", "all_to_all")
        )
        print(
            f"# {r['world']:>5} {r['L']:>6} {r['halo_size']:>6}{a2a['fb_ms'] / eager['fb_ms']:>17.2f}"
            f"{r['fb_ms'] / eager['fb_ms']:>15.2f}{max(r['wire']) / max(max(eager['wire']), 1):>11.2f}"
        )
