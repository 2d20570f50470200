"""One training step, the DP x CP run built from it, and the one-process reference built from it."""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from cp_support.memory import peak_mib, reset_peak
from cp_support.models import build_model
from cp_support.traffic import count_step
from examples.train.checkpoint import latest_checkpoint, load, save
from examples.train.parallel import IMPLEMENTATIONS, apply_ac, apply_compile, apply_cp, apply_fsdp, log
from torch_impl import hf


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
        per_layer = [0] * len(model.model.layers)
        for call in count_step(model, local):
            if call.tag is not None:  # None: before the first layer (the inputs' cross-rank check)
                per_layer[call.tag[1]] += call.received
        report[transport] = per_layer
        model.zero_grad(set_to_none=True)
    model.set_attn_implementation(chosen)
    return report


def step(model, optimizer, batch, max_norm):
    """One training step on `batch` (model kwargs): forward, backward, clipping, AdamW. Returns the
    loss (this rank's share under CP). The DP x CP run and the one-process reference both take it."""
    out = model(**batch)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


def make_optimizer(model, args):
    return torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )


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
    for k in range(start, args.steps):
        began = time.perf_counter()
        local = local_batch(corpus, k, mesh, args.batch, device, args.layout)
        loss = step(model, optimizer, local, args.clip).double()
        dist.all_reduce(loss)  # the ranks' shares add up to the global mean
        times.append(time.perf_counter() - began)
        losses[k + 1] = loss.item()
        bar.update(1)
        log(f"step {k + 1:4d}  loss {losses[k + 1]:.6f}  {tokens_per_step / times[-1]:,.0f} tokens/s")
        if args.save_dir and args.save_every and ((k + 1) % args.save_every == 0 or k + 1 == args.steps):
            save(model, optimizer, k + 1, (k + 1) * rows_per_step, args.save_dir)
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
    for k in range(args.steps):
        batch = {key: value.to(device) for key, value in corpus.batch(k * rows, rows).items()}
        loss = step(model, optimizer, batch, args.clip)
        if k + 1 in steps:
            losses[k + 1] = loss.item()
    return losses, model.state_dict()


def progress(total, done):
    from tqdm import tqdm

    return tqdm(
        total=total, initial=done, desc="training", unit="step", disable=dist.get_rank() != 0, file=sys.stdout
    )
