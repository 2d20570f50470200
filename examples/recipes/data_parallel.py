"""Recipe: your own DP x CP training loop, gradients reduced by DDP or FSDP2 through torch_impl.hf.

    torchrun --standalone --nproc-per-node 4 -m examples.recipes.data_parallel --wrap fsdp2
    torchrun --standalone --nproc-per-node 4 -m examples.recipes.data_parallel --wrap ddp
    torchrun --standalone --nproc-per-node 4 -m examples.recipes.data_parallel --wrap ddp-as-is

A 2 x 2 ("dp", "cp") mesh: each DP rank takes one row of the global batch, its CP ranks split that
row's 256 tokens. Each rank's loss is its share of its row's mean (`hf.shard_batch`), so the CP
ranks' gradients are summed and the DP ranks' averaged: `hf.apply_fsdp` / `hf.apply_ddp` set that
up. DDP wrapped as it is averages over all 4 ranks instead: half the gradients (`--wrap ddp-as-is`
shows it). Every rank also runs one process on the whole batch and compares, step by step: the
loss, every gradient before AdamW steps (AdamW's update would hide a scaled gradient), and at the
end the parameters. float64, but transformers' RMS norms and loss compute in float32, and a float32
step given float64 inputs that differ in their last bits may round one ulp (2^-23 relative) apart:
to 1e-6 of each tensor's largest entry (measured: 1e-12; the printed losses differ in the 7th
digit; DDP wrapped as it is: 0.5).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
import transformers as tf

from examples.recipes.common import finish
from torch_impl import hf

STEPS, ROWS, SEQ = 3, 2, 256
TOLERANCE = 1e-6  # of each tensor's largest entry (the docstring)


def build():
    torch.manual_seed(0)  # the same weights on every rank (or load the same checkpoint)
    config = tf.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=96,  # a window that spans the previous CP shard
    )
    return tf.MistralForCausalLM(config).double()  # float64: the comparison sees no float32 rounding


def full(t):
    """A parameter or gradient, whole (FSDP2 holds them as sharded DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["ddp", "fsdp2", "ddp-as-is"], default="fsdp2")
    wrap = parser.parse_args().wrap
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = mesh["dp"].get_local_rank()

    model = hf.parallelize(build(), mesh["cp"], verbose=dist.get_rank() == 0)
    if wrap == "fsdp2":
        model = hf.apply_fsdp(model, mesh)
    elif wrap == "ddp":
        model = hf.apply_ddp(model, mesh)
    else:  # the trap: DDP's own average over the flattened dp x cp ranks
        model = DistributedDataParallel(model, process_group=mesh._flatten().get_group())
    one = build()  # the reference: one process, the whole batch
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, one)]

    worst = 0.0
    for step in range(STEPS):
        ids = torch.randint(0, 128, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))
        batch = {"input_ids": ids, "labels": ids}
        out = model(**hf.shard_batch({k: v[dp : dp + 1] for k, v in batch.items()}, mesh["cp"]))
        out.loss.backward()
        loss = out.loss.detach() / mesh["dp"].size()  # this rank's share of the mean over DP
        dist.all_reduce(loss)
        ref = one(**hf.shard_batch(batch, None))
        ref.loss.backward()
        grads = dict(one.named_parameters())
        apart = max(
            ((full(p.grad) - grads[name].grad).abs().max() / grads[name].grad.abs().max()).item()
            for name, p in (model if wrap == "fsdp2" else model.module).named_parameters()
        )
        worst = max(worst, apart)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss.item():.6f} (one process {ref.loss.item():.6f}), ", end="")
            print(f"gradients apart by at most {apart:.1e} of their largest entry")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    params = dict(one.named_parameters())
    drift = max(
        ((full(p.detach()) - params[name]).abs().max() / params[name].abs().max()).item()
        for name, p in (model if wrap == "fsdp2" else model.module).named_parameters()
    )
    verdict = "EQUAL" if max(worst, drift) <= TOLERANCE else "DIFFERENT"
    if dist.get_rank() == 0:
        print(f"{verdict} ({wrap}): after {STEPS} AdamW steps the parameters are apart by {drift:.1e}")
        print(f"largest difference {max(worst, drift):.3e} (tolerance {TOLERANCE:g})")
    finish(verdict == "EQUAL")


if __name__ == "__main__":
    main()
