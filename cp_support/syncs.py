"""Reads of tensor values on the host, counted where they happen: on a GPU each one waits for the
stream to finish what it has queued (a sync); on the CPU the same calls mark where a GPU would wait."""

import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = (
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
)


class HostReads(TorchFunctionMode):
    """with HostReads() as reads: ...; then reads.library, where the library made each read of a
    tensor's values on the host ("torch_impl/hf/inputs.py:123 __call__": the innermost frame in
    torch_impl, also for reads inside the functions it calls), and reads.others, how many reads
    the rest made (the model's own code). Reads inside custom ops' kernels (the CPU attention's
    `tiled_attention`, which reads CPU tensors only) are not seen: torch does not run function
    modes there."""

    def __init__(self):
        super().__init__()
        self.library, self.others = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch_impl/" in f.filename]
            if frames:
                path = "torch_impl/" + frames[-1].filename.rsplit("/torch_impl/", 1)[1]
                self.library.append(f"{path}:{frames[-1].lineno} {frames[-1].name}")
            else:
                self.others += 1
        return func(*args, **(kwargs or {}))
