"""make bench's decoder-layer rows: one Gemma 3 decoder layer made CP by torch_impl.hf, eager and under
torch.compile, forward+backward."""

import statistics
import time

import torch
import torch.distributed as dist

from cp_support.launch import run_ranks

# --- torch.compile of a Gemma 3 decoder layer under CP -------------------------------------------


def layer_inputs(model, local):
    """Each decoder layer's (args, kwargs) in one forward of the model."""
    captured, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        hook = lambda module, args, kwargs, index=index: captured.setdefault(index, (args, kwargs))  # noqa: E731
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(**local)
    for handle in handles:
        handle.remove()
    return captured


def layer_rank(rank, world, cfg, reps):
    """examples.train's Gemma 3 made CP by torch_impl.hf; for a sliding-window and a global decoder
    layer, one forward+backward eager and compiled (inductor, fullgraph=True): per rep, the
    slowest rank's time."""
    from cp_support.models import VOCAB, build_model
    from torch_impl import hf

    torch.set_num_threads(1)
    group, S = dist.group.WORLD, world * cfg["L"]
    model = build_model("gemma3", S, cfg["window"], torch.float32)
    hf.parallelize(model, group)
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(0))
    inputs = layer_inputs(model, hf.shard_batch({"input_ids": ids}, group))
    kinds = model.config.layer_types
    times = {}
    for kind in ("sliding_attention", "full_attention"):
        index = kinds.index(kind)
        layer, (args, kwargs) = model.model.layers[index], inputs[index]
        variants = {"eager": layer, "compiled": torch.compile(layer, backend=cfg["backend"], fullgraph=True)}

        def run(fn, args=args, kwargs=kwargs):
            x = args[0].detach().requires_grad_(True)
            y = fn(x, *args[1:], **kwargs)
            y.backward(torch.ones_like(y))

        for fn in variants.values():
            run(fn)  # warm-up (compiles)
        times |= {(kind, name): [] for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                dist.barrier(group)
                start = time.perf_counter()
                run(fn)
                times[(kind, name)].append(time.perf_counter() - start)
    return times


def layer_bench(world, cfg, reps):
    per_rank = run_ranks(layer_rank, world, cfg, reps, timeout_s=900, env={"OMP_NUM_THREADS": "1"})
    rows = []
    for kind in ("sliding_attention", "full_attention"):
        ms = {
            name: 1000 * statistics.median(max(r[(kind, name)][i] for r in per_rank) for i in range(reps))
            for name in ("eager", "compiled")
        }
        rows.append({"world": world, **cfg, "layer": kind, **{f"{k}_ms": v for k, v in ms.items()}})
        rows[-1]["compiled_ratio"] = ms["compiled"] / ms["eager"]
    shape = f"n={world}, L={cfg['L']}, window {cfg['window']}"
    print(f"# torch.compile ({cfg['backend']}): a Gemma 3 decoder layer made CP ({shape})")
    for r in rows:
        print(
            f"#   {r['layer']:<18} eager {r['eager_ms']:8.1f} ms  compiled {r['compiled_ms']:8.1f} ms"
            f"  ratio {r['compiled_ratio']:.2f}"
        )
    return rows
