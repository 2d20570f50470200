"""Count the bytes a rank moves through torch.distributed, as it runs (not from a formula).

Two counters, both per process:

* `PayloadCounter`, a TorchDispatchMode that sees every c10d call (torch.distributed, functional
  collectives, DTensor) and tallies the payload it hands to the backend: what this rank receives
  from and sends to its peers. For a collective this is the data a rank must exchange whatever the
  algorithm: an all-gather of an `s`-byte shard over n ranks receives and sends (n-1)*s; a
  reduce-scatter into an `s`-byte block likewise (n-1)*s; a scatter from the root sends each peer
  its chunk. A c10d call it does not know raises, so nothing passes uncounted.
* `wire_bytes()`, the bytes this process's TCP sockets received and had acknowledged (Linux
  TCP_INFO): what gloo really put on the wire, its algorithm and message headers included. It
  sees gloo only (NCCL does not use the process's sockets for the data).
"""

import math
import os
import socket
import stat
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

_NO_PAYLOAD = {"barrier", "monitored_barrier", "wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(t):
    return t.numel() * t.element_size()


def _flat(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        else:
            yield item


def _payload(name, args):
    """(received, sent) bytes of one c10d call, from its arguments."""
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_"):
        out, inp = sum(map(_nbytes, _flat([args[0]]))), sum(map(_nbytes, _flat([args[1]])))
        return out - inp, out - inp
    if name == "all_gather_into_tensor":  # functional: (input, group_size, group_name)
        moved = (args[1] - 1) * _nbytes(args[0])
        return moved, moved
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_"):
        out, inp = sum(map(_nbytes, _flat([args[0]]))), sum(map(_nbytes, _flat([args[1]])))
        return inp - out, inp - out
    if name == "reduce_scatter_tensor":  # functional: (input, reduce_op, group_size, group_name)
        moved = _nbytes(args[0]) * (args[2] - 1) // args[2]
        return moved, moved
    if name == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group_name)
        row = math.prod(args[0].shape[1:]) * args[0].element_size()  # bytes per split unit (dim 0)
        mine = dist.get_rank(_resolve_process_group(args[3]))
        return (sum(args[1]) - args[1][mine]) * row, (sum(args[2]) - args[2][mine]) * row
    if name == "allreduce_":  # (tensors, group, op, ...): a reduce-scatter and an all-gather's worth
        n = dist.ProcessGroup.unbox(args[1]).size()
        moved = sum(map(_nbytes, args[0])) * 2 * (n - 1) // n
        return moved, moved
    if name == "send":
        return 0, sum(map(_nbytes, args[0]))
    if name == "recv_":
        return sum(map(_nbytes, args[0])), 0
    if name == "scatter_":  # (outputs, inputs, group, root, ...): only the root has inputs
        chunks = list(_flat([args[1]]))
        mine = sum(map(_nbytes, args[0]))
        return (0, sum(map(_nbytes, chunks)) - mine) if chunks else (mine, 0)
    raise NotImplementedError(f"PayloadCounter does not know c10d op {name!r}")


class Call(NamedTuple):
    tag: object  # the counter's `tag` when the call was made (e.g. a layer name), or None
    op: str  # the c10d op, e.g. "_allgather_base_", "send", "recv_"
    dtype: torch.dtype
    received: int  # bytes
    sent: int


class PayloadCounter(TorchDispatchMode):
    """with PayloadCounter() as c: ...; then c.received, c.sent (bytes) and c.calls (c10d calls).

    `c.log` lists every call (a `Call`); set `c.tag` while counting to attribute calls, e.g. to layers.
    """

    def __init__(self):
        super().__init__()
        self.received = self.sent = self.calls = 0
        self.log, self.tag = [], None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1].split(".")[0]
        if "c10d" in func.namespace and name not in _NO_PAYLOAD:
            received, sent = _payload(name, args)
            self.received += received
            self.sent += sent
            self.calls += 1
            dtype = next(t.dtype for t in _flat(args) if isinstance(t, torch.Tensor))
            self.log.append(Call(self.tag, name, dtype, received, sent))
        return func(*args, **(kwargs or {}))


def wire_bytes():
    """(received, sent) bytes over all of this process's TCP sockets so far."""
    received = sent = 0
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                acked, got = struct.unpack_from("QQ", info, 120)  # tcpi_bytes_acked, tcpi_bytes_received
                received, sent = received + got, sent + acked
    return received, sent


def tag_layers(counter, layers):
    """Tag the calls `counter` sees with ("forward" | "backward", i) while layers[i] runs.

    Forward pre-hooks tag a layer's forward; full backward pre-hooks its backward (without
    activation checkpointing: recomputed forwards would be tagged as backward). Returns the handles.
    """

    def tagger(direction, index):
        def hook(*_):
            counter.tag = (direction, index)

        return hook

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(tagger("forward", index)))
        handles.append(layer.register_full_backward_pre_hook(tagger("backward", index)))
    return handles


def count_step(model, kwargs):
    """Every c10d call of one forward+backward of `model(**kwargs).loss`, tagged with its decoder
    layer (tag_layers): the counter's log."""
    counter = PayloadCounter()
    handles = tag_layers(counter, model.model.layers)
    with counter:
        model(**kwargs).loss.backward()
    for handle in handles:
        handle.remove()
    return counter.log
