"""The process's resident-set high-water mark, resettable (Linux /proc), for peak-memory figures;
and the largest tensor an operation makes (`LargestTensor`), for bounds that must not grow with L x T."""

import gc
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak():
    """Set the high-water mark (VmHWM) to the current resident set (VmRSS); returns it, in MiB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") / 1024


def peak_mib():
    """The resident set's high-water mark since the last reset_peak (or the process start), in MiB."""
    return _status_kib("VmHWM") / 1024


class SeesInside(TorchDispatchMode):
    """A dispatch mode that sees the ops inside the library's own (`torch_impl::`, e.g. the CPU
    attention's `tiled_attention`), which would otherwise reach it as one op: their CPU kernel runs
    under the mode. Subclasses define `op(func, args, kwargs)`, called for every other op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "torch_impl":
            with self:
                kernel = torch.library.get_kernel(func, "CPU")
                return kernel.call_boxed(torch.DispatchKeySet("CPU"), *args, **kwargs)
        return self.op(func, args, kwargs)


class LargestTensor(SeesInside):
    """with LargestTensor() as m: ...; then m.numel, the most elements of any tensor an op made."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def op(self, func, args, kwargs):
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out
