"""The job's command line and setup: arguments, the process group, the mesh, then the run."""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cp_support.corpus import Corpus
import examples.train
from examples.train.loop import train_cp
from examples.train.parallel import IMPLEMENTATIONS, log
from examples.train.report import report


def parse(argv):
    p = argparse.ArgumentParser(description=examples.train.__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=None, help="CP ranks (default: world size / dp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=4096, help="global tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per DP rank and step")
    p.add_argument("--model", choices=("gemma3", "lfm2", "deepseek_v32", "qwen3_5"), default="gemma3")
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
