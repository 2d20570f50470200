"""The main job: a transformers hybrid LM trained with DP x CP under torchrun, equal to one process.

    torchrun --standalone --nproc-per-node 4 -m examples.train --cp 4 --reference
    torchrun --standalone --nproc-per-node 2 -m examples.train --dp 2 --cp 1   (pure data parallelism)
    python -m examples.train --reference                                        (one process)
    torchrun ... -m examples.train --dp D --cp C --steps N --seq-len S --model M [--reference]
        M: gemma3 (default), lfm2, deepseek_v32
    two nodes: on each, torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
                   --rdzv-endpoint HOST:PORT -m examples.train --dp 2 --cp 2 ...

What it does, in order:
1. Process group (gloo on CPU; NCCL with one GPU per rank when CUDA is available) and the mesh
   `init_device_mesh(device, (D, C), mesh_dim_names=("dp", "cp"))`.
2. The model, from a config with a fixed seed (no downloads): `gemma3` (default) is Gemma 3's text
   model with its 5:1 layout of sliding-window and global layers, the window reaching back over
   more than one CP shard; `lfm2` is LFM2's short convolutions with global attention;
   `deepseek_v32` is DeepSeek V3.2's sparse attention (MLA, an indexer choosing `--window` keys per
   query; MoE) in every layer. Vocabulary 256: the tokens are bytes.
3. Parallelized in torchtitan's order: CP (`hf.parallelize(model, mesh["cp"])`), activation
   checkpointing (`--ac`, with `hf.checkpoint_kwargs()`), per-layer
   `torch.compile(fullgraph=True)` (`--compile`), FSDP2.
   FSDP2 (`hf.apply_fsdp`, `fully_shard`) shards every decoder layer and the root over the
   flattened dp x cp mesh, with gradient divide factor 1 (`global_num_items=True`): each rank's
   loss is already its share of the global mean (`num_items_in_batch` counts the valid labels of
   all DP batches), so the summed gradients are exactly the one-process gradients. FSDP2 is exact
   on gloo (its reduce-scatter sums in the parameters' dtype, as one process's backward does).
4. Data: the standard library's own `.py` files, sorted by name, as bytes; step k's batch is the
   rows k*D*B .. (k+1)*D*B - 1 of S tokens each, DP rank d taking B of them.
5. AdamW with gradient clipping; a progress bar and one log line per step (step, loss, tokens/s).
   `--save-dir DIR --save-every K` checkpoints model, optimizer, step and data position with
   torch.distributed.checkpoint; `--resume` continues from the latest checkpoint there.
6. Before training, one extra forward+backward per transport (not a training step) counts the
   bytes each rank receives per step, per layer, through this library and through the baseline that
   all-gathers K and V in every attention layer (examples/allgather.py; `--transport allgather`
   trains with it instead). Counted without activation checkpointing: with `--ac` in eager mode
   the backward's recomputation repeats each layer's forward exchange (compiled, it keeps them).
7. `--reference`: rank 0 then trains the same model from the same seed on the same data in one
   process (the D batches as one batch, no CP) and prints per step both losses and their
   difference, how far apart the trained parameters ended, peak resident memory per rank,
   tokens/s, bytes per step, and the figure out/loss_curves.png. Exit status 1 if any step's
   losses differ by more than the tolerance:

   Tolerance. transformers computes the loss in float32 whatever the model's dtype
   (`ForCausalLMLoss` upcasts the logits with `.float()`), and Gemma 3's and LFM2's RMS norms
   too: one process sums D*B*S token losses in float32, CP sums n partial sums and adds them, so
   the two losses differ by float32 rounding of the sum even in float64: torch adds a float32 sum
   pairwise (cascade), within log2(N) u of the sum of its N positive terms each (u = 2^-24), the
   two sums 2 log2(N) u |loss| apart; and the float32 norms round the (float64-equal) hidden states
   of the two runs to float32 values that may differ by an ulp. float64: 1e-5 (2 * 10 * 2^-24 * 8:
   up to 1024 tokens a step, losses up to 8; measured 2.4e-7, one ulp at a loss of 4). float32:
   the whole model rounds, differently in the two runs (attention sums in another order), and
   AdamW amplifies early rounding differences (its first updates are lr * g/|g|: a gradient
   component near zero whose rounding differs moves its parameter by up to a full lr in the other
   direction); measured here: at most 1.1e-6 on the loss over 20 steps, parameters apart by about
   1e-4 of their tensor's largest entry; 1e-4 on the loss leaves a margin for longer runs.
   `deepseek_v32` makes discrete choices from float32 scores (the indexer's top-k keys, the MoE
   router's top-2 experts, both computed in float32 whatever the dtype): a float32 rounding
   difference between the two runs can flip a near-tied choice, and the runs part slowly
   (measured at --seq-len 512 --window 64, 10 steps: dp 2 x cp 2 7.2e-7; cp 4 3.3e-5 at step 10,
   growing). In float64 the scores'
   inputs agree to float64 rounding and no choice flips: EQUAL (4.8e-7 over 4 steps).
"""

import argparse
import gc
import json
import os
from pathlib import Path
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from examples import allgather
from examples.memory import peak_mib, reset_peak
from torch_impl import hf
from torch_impl.traffic import PayloadCounter, tag_layers

TOLERANCE = {"float64": 1e-5, "float32": 1e-4}
IMPLEMENTATIONS = {"torch_impl": hf.IMPLEMENTATION, "allgather": allgather.IMPLEMENTATION}  # --transport
VOCAB = 256


def log(text):
    """One line from rank 0, printed above the progress bar."""
    if dist.get_rank() == 0:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)


# --- the model ---------------------------------------------------------------------------------


def build_model(name, seq_len, window, dtype, seed=0):
    """A small transformers hybrid LM with random weights, the same on every rank for the seed."""
    import transformers as tf

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4}
    common |= {"num_key_value_heads": 1, "max_position_embeddings": seq_len}
    if name == "gemma3":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's 5:1 pattern
        config = tf.Gemma3TextConfig(
            **common,
            num_hidden_layers=len(layer_types),
            layer_types=layer_types,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=window,
        )
        model = tf.Gemma3ForCausalLM(config)
    elif name == "deepseek_v32":
        layer_types = ["indexed_attention"] * 4  # DeepSeek Sparse Attention in every layer
        config = tf.DeepseekV32Config(
            **common | {"num_key_value_heads": 4},  # MLA expands its latents to every head
            num_hidden_layers=len(layer_types),
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=window,  # each query attends to the `--window` keys its indexer scores highest
            index_head_dim=32,
            index_n_heads=16,
            use_cache=False,
        )
        model = tf.DeepseekV32ForCausalLM(config)
        if dtype == torch.float64:  # grouped_mm has no float64 kernel on CPU
            model.set_experts_implementation("eager")
    elif name == "lfm2":
        layer_types = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
        config = tf.Lfm2Config(**common, num_hidden_layers=len(layer_types), layer_types=layer_types)
        model = tf.Lfm2ForCausalLM(config)
    else:
        raise ValueError(f"`--model` must be gemma3, lfm2 or deepseek_v32, got {name!r}")
    return model.to(dtype)


# --- the data ----------------------------------------------------------------------------------


class Corpus:
    """Byte tokens of the standard library's own .py files (sorted by name), cut into rows of S."""

    def __init__(self, seq_len):
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(f.read_bytes() for f in files)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len, self.rows = seq_len, len(data) // seq_len
        if self.rows == 0:
            raise ValueError(f"`--seq-len` {seq_len} is longer than the corpus ({len(data)} bytes)")

    def batch(self, first_row, rows):
        """input_ids and labels [rows, S]: rows first_row, first_row + 1, ... (wrapping around)."""
        index = (torch.arange(first_row, first_row + rows) % self.rows)[:, None] * self.seq_len
        ids = self.tokens[index + torch.arange(self.seq_len)]
        return {"input_ids": ids, "labels": ids.clone()}


# --- parallelizing (torchtitan's order: CP, activation checkpointing, compile, FSDP) -------------


def apply_cp(model, mesh, transport, layout):
    if mesh["cp"].size() == 1:
        log("No CP (--cp 1): every rank holds whole sequences; the model's own attention")
        return
    hf.parallelize(model, mesh["cp"], layout=layout)
    model.set_attn_implementation(IMPLEMENTATIONS[transport])
    log(f"Applied CP over {mesh['cp'].size()} ranks ({transport}, layout {layout})")


def apply_ac(model):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    log("Applied activation checkpointing to every decoder layer (the transport's outputs are kept)")


def apply_compile(model):
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    log("Applied torch.compile(fullgraph=True) to every decoder layer")


def apply_fsdp(model, mesh):
    hf.apply_fsdp(model, mesh, global_num_items=True)  # each rank's loss: its share of the global mean
    log(f"Applied FSDP2 over the flattened dp x cp mesh ({mesh.size()} ranks), gradients summed")


# --- one step ----------------------------------------------------------------------------------


def local_batch(corpus, step, mesh, batch_size, device, layout="contiguous"):
    """This rank's model kwargs for the step, the loss normalized by the count over all DP batches."""
    dp = mesh["dp"]
    first = (step * dp.size() + dp.get_local_rank()) * batch_size
    batch = {key: value.to(device) for key, value in corpus.batch(first, batch_size).items()}
    local = hf.shard_batch(batch, mesh["cp"], layout=layout)
    count = local["num_items_in_batch"].clone()
    dist.all_reduce(count, group=dp.get_group())
    local["num_items_in_batch"] = count
    return local


def measure_transport(model, local, transports):
    """Per transport: the bytes this rank receives in one forward+backward, per decoder layer
    (forward and backward added), counted at the c10d calls. Not a training step: grads are dropped,
    and the model keeps its transport."""
    report, chosen = {}, model.config._attn_implementation
    for transport in transports:
        model.set_attn_implementation(IMPLEMENTATIONS[transport])
        counter = PayloadCounter()
        handles = tag_layers(counter, model.model.layers)
        with counter:
            model(**local).loss.backward()
        for handle in handles:
            handle.remove()
        per_layer = [0] * len(model.model.layers)
        for call in counter.log:
            if call.tag is not None:  # None: before the first layer (the inputs' cross-rank check)
                per_layer[call.tag[1]] += call.received
        report[transport] = per_layer
        model.zero_grad(set_to_none=True)
    model.set_attn_implementation(chosen)
    return report


def clip_and_step(model, optimizer, max_norm):
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_optimizer(model, args):
    return torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )


# --- checkpoints -------------------------------------------------------------------------------


def save(model, optimizer, step, next_row, directory):
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": step, "next_row": next_row}}
    dcp.save(state, checkpoint_id=os.path.join(directory, f"step-{step:06d}"))


def latest_checkpoint(directory):
    found = sorted(Path(directory).glob("step-*")) if directory and os.path.isdir(directory) else []
    return str(found[-1]) if found else None


def load(model, optimizer, path, rows_per_step):
    """Restore model and optimizer in place; returns the step the checkpoint was taken after. Its
    data position must be where this run's step would read next (same --dp and --batch)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": 0, "next_row": 0}}
    dcp.load(state, checkpoint_id=path)
    step, next_row = state["progress"]["step"], state["progress"]["next_row"]
    if next_row != step * rows_per_step:
        raise ValueError(
            f"{path} stopped at data row {next_row} after step {step}; this run reads {rows_per_step} rows a "
            "step (--dp x --batch): resume with the --dp and --batch it was saved with"
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


# --- the runs ----------------------------------------------------------------------------------


def train_cp(args, mesh, corpus, device):
    """The DP x CP run; returns per-step global losses, step times, the peak resident memory of the
    training steps (MiB), the transport report, and the trained parameters, whole, on rank 0 (empty
    elsewhere)."""
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, args.seq_len, args.window, dtype, args.seed).to(device)
    apply_cp(model, mesh, args.transport, args.layout)
    transport = {}  # without CP nothing moves
    if mesh["cp"].size() > 1:  # the all-gather baseline knows the contiguous layout only
        transports = IMPLEMENTATIONS if args.layout == "contiguous" else ("torch_impl",)
        transport = measure_transport(
            model, local_batch(corpus, 0, mesh, args.batch, device, args.layout), transports
        )
    if args.ac:
        apply_ac(model)
    if args.compile:
        apply_compile(model)
    apply_fsdp(model, mesh)
    optimizer = make_optimizer(model, args)
    rows_per_step = mesh["dp"].size() * args.batch
    start = 0
    if args.resume and (path := latest_checkpoint(args.save_dir)):
        start = load(model, optimizer, path, rows_per_step)
        log(f"Resumed from {path} after step {start}")
    tokens_per_step = rows_per_step * args.seq_len
    losses, times = {}, []
    bar = progress(args.steps, start)
    reset_peak()  # the peak below is the training steps'
    for step in range(start, args.steps):
        began = time.perf_counter()
        out = model(**local_batch(corpus, step, mesh, args.batch, device, args.layout))
        out.loss.backward()
        clip_and_step(model, optimizer, args.clip)
        loss = out.loss.detach().double()
        dist.all_reduce(loss)  # the ranks' shares add up to the global mean
        times.append(time.perf_counter() - began)
        losses[step + 1] = loss.item()
        bar.update(1)
        log(f"step {step + 1:4d}  loss {losses[step + 1]:.6f}  {tokens_per_step / times[-1]:,.0f} tokens/s")
        if (
            args.save_dir
            and args.save_every
            and ((step + 1) % args.save_every == 0 or step + 1 == args.steps)
        ):
            save(model, optimizer, step + 1, (step + 1) * rows_per_step, args.save_dir)
    bar.close()
    peak = peak_mib()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return losses, times, peak, transport, get_model_state_dict(model, options=options)


def train_reference(args, corpus, device, steps):
    """One process, no CP: the D data-parallel batches of each step as one batch."""
    model = build_model(args.model, args.seq_len, args.window, getattr(torch, args.dtype), args.seed).to(
        device
    )
    optimizer = make_optimizer(model, args)
    rows = args.dp * args.batch
    losses = {}
    for step in range(args.steps):
        out = model(**{k: v.to(device) for k, v in corpus.batch(step * rows, rows).items()})
        out.loss.backward()
        clip_and_step(model, optimizer, args.clip)
        if step + 1 in steps:
            losses[step + 1] = out.loss.item()
    return losses, model.state_dict()


def progress(total, done):
    from tqdm import tqdm

    return tqdm(
        total=total, initial=done, desc="training", unit="step", disable=dist.get_rank() != 0, file=sys.stdout
    )


# --- reporting ---------------------------------------------------------------------------------


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


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=None, help="CP ranks (default: world size / dp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=4096, help="global tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per DP rank and step")
    p.add_argument("--model", choices=("gemma3", "lfm2", "deepseek_v32"), default="gemma3")
    p.add_argument(
        "--window", type=int, default=1536, help="Gemma 3's sliding window; DeepSeek V3.2's index_topk"
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (fullgraph)")
    p.add_argument("--transport", choices=tuple(IMPLEMENTATIONS), default="torch_impl")
    p.add_argument(
        "--layout",
        choices=("contiguous", "head_tail"),
        default="contiguous",
        help="which tokens a CP rank holds (head_tail: chunks r and 2n-1-r, balanced causal work)",
    )
    p.add_argument("--reference", action="store_true", help="then train on one process and compare")
    p.add_argument("--tolerance", type=float, default=None, help="override the dtype's tolerance")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--metrics", default=None, help="write per-step losses and measurements (JSON) here")
    p.add_argument("--figure", default="out/loss_curves.png")
    return p.parse_args(argv)


def main(argv=None):
    job_start = time.perf_counter()
    args = parse(argv)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # `python -m examples.train`: one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    args.cp = args.cp or world // args.dp
    if args.dp * args.cp != world:
        raise ValueError(f"`--dp` {args.dp} x `--cp` {args.cp} must equal the world size {world}")
    if args.layout != "contiguous" and args.transport != "torch_impl":
        raise ValueError(
            f"`--layout {args.layout}` needs `--transport torch_impl` (the baseline is contiguous)"
        )
    mesh = init_device_mesh(device.type, (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    corpus = Corpus(args.seq_len)
    log(
        f"{args.model}, {args.dtype}, {backend}: {world} rank{'s' * (world > 1)} = dp {args.dp} x "
        f"cp {args.cp}, {args.seq_len} tokens per sequence ({args.seq_len // args.cp} per CP rank), "
        f"{args.batch} per DP rank, {args.steps} steps; "
        f"corpus {corpus.rows} sequences of the standard library's .py files"
    )
    started = time.perf_counter()
    losses, times, peak, transport, params = train_cp(args, mesh, corpus, device)
    elapsed = time.perf_counter() - started
    per_rank = [None] * world
    dist.all_gather_object(per_rank, (peak, transport))
    rank = dist.get_rank()
    gc.collect()  # the FSDP model's reference cycles, with any gloo work they hold, while gloo is up
    dist.destroy_process_group()  # every rank at once; the report and the reference are one process's
    return (
        report(args, corpus, device, losses, times, elapsed, per_rank, params, job_start) if rank == 0 else 0
    )


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
        metrics["parameter_difference"] = drift
        title = (
            f"{args.model}, {args.dtype}: dp {args.dp} x cp {args.cp} (contiguous shards), "
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


if __name__ == "__main__":
    sys.exit(main())
