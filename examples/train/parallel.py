"""The parallelisms, applied in torchtitan's order: CP, activation checkpointing, compile, FSDP."""

import sys

import torch.distributed as dist

from cp_support import allgather
from torch_impl import hf

IMPLEMENTATIONS = {"torch_impl": hf.IMPLEMENTATION, "allgather": allgather.IMPLEMENTATION}  # --transport


def log(text):
    """One line from rank 0, printed above the progress bar."""
    if dist.get_rank() == 0:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)


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
