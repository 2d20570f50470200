"""What each gloo rank runs: torch_impl on its shard of a host-made global input.

Each function takes the rank's CP group and a list of configurations (one round trip for many of
them) and returns, per configuration, the rank's output, input gradient and checks. Inputs arrive
as numpy float64/int/bool arrays and a dtype name: integer-valued data converts exactly.
"""

import importlib

import numpy as np
import torch
import torch.distributed as dist

import torch_impl

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "bfloat16", "float16", "bool", "int32", "int64", "uint8")
}


def local_shard(global_x, group, dtype, noncontiguous=False):
    """Rank r's rows [r*L, (r+1)*L) of global_x (for layouts other than contiguous, global_x comes
    in device order: expected.device_order) as a torch tensor; optionally a strided view."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    L = global_x.shape[1] // n
    x = torch.from_numpy(np.ascontiguousarray(global_x[:, r * L : (r + 1) * L])).to(DTYPES[dtype])
    if noncontiguous:  # every other token of a twice-as-long buffer
        buf = torch.zeros((x.shape[0], 2 * L, *x.shape[2:]), dtype=x.dtype)
        buf[:, ::2] = x
        x = buf[:, ::2]  # not contiguous unless it has a single token per batch row
    return x


def _forward_backward(fn, group, config):
    x = local_shard(config["x"], group, config["dtype"], config.get("noncontiguous", False))
    x.requires_grad_(True)
    before = x.detach().clone()
    y = fn(x)
    cotangent = torch.from_numpy(config["cotangents"][dist.get_rank(group)]).to(x.dtype)
    y.backward(cotangent)
    return {
        "y": y.detach().clone(),
        "grad": x.grad,
        "y_is_x": y is x,
        "mutated": not torch.equal(x.detach(), before),
        "cotangent_mutated": not torch.equal(
            cotangent, torch.from_numpy(config["cotangents"][dist.get_rank(group)]).to(x.dtype)
        ),
    }


def _transport(name):
    """ "module.function", e.g. "torch_impl.gather_halo" or one of parity_tests.harness.mutants."""
    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), function)


def _layout(config):
    """The layout (and gather_halo's lookahead) keywords where a configuration names them (the
    mutants take none)."""
    return {key: config[key] for key in ("layout", "lookahead") if key in config}


def halo(group, configs, transport="torch_impl.gather_halo"):
    gather_halo = _transport(transport)
    return [
        _forward_backward(
            lambda x, c=c: gather_halo(x, group, c["halo_size"], c["left_padding"], **_layout(c)), group, c
        )
        for c in configs
    ]


def sequence(group, configs, transport="torch_impl.gather_sequence"):
    gather_sequence = _transport(transport)
    return [
        _forward_backward(lambda x, c=c: gather_sequence(x, group, **_layout(c)), group, c) for c in configs
    ]


def metadata(group, configs):
    out = []
    for c in configs:
        x = local_shard(c["x"], group, c["dtype"], c.get("noncontiguous", False))
        y = torch_impl.gather_metadata(x, group, **_layout(c))
        out.append({"y": y.clone(), "y_is_x": y is x, "requires_grad": y.requires_grad})
    return out


def bad_arguments(group, calls):
    """Each (function name, x shape, dtype, requires_grad, kwargs) call must raise ValueError on every
    rank, before any communication; returns the messages (None where nothing was raised).

    A final good gather proves that no half-posted send or receive was left behind.
    """
    messages = []
    for name, shape, dtype, requires_grad, kwargs in calls:
        x = torch.zeros(shape, dtype=DTYPES[dtype]).requires_grad_(requires_grad)
        try:
            getattr(torch_impl, name)(x, group, **kwargs)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    y = torch_impl.gather_sequence(torch.full((1, 2, 3), dist.get_rank(group) + 1.0), group)
    return messages, y[0, :, 0].tolist()


def hybrid_block(group, config, batch, seq_len, pad):
    """The demo's block on this rank, rebuilt from seeds: (output, input grad, summed param grads)."""
    from examples import hybrid_block as hb

    dtype = DTYPES[config["dtype"]]
    block = hb.make_block(config["dim"], config["heads"], config["kernel"], config["window"], dtype)
    inputs = hb.make_inputs(batch, seq_len, config["dim"], pad, dtype)
    return hb.cp_forward_backward(block, *inputs[:2], group, *inputs[2:])


def halo_bytes(group, halo_sizes, L, D, layout="contiguous", compiled=True):
    """Per halo size: bytes this rank received in one forward+backward of gather_halo under
    `layout`, counted at the c10d calls for the eager p2p exchange and for the all_to_all one that
    torch.compile traces, and (compiled) the TCP bytes of the compiled call (a dispatch mode cannot
    watch compiled code)."""
    from cp_support.traffic import PayloadCounter, wire_bytes
    from torch_impl.halo import halo_all_to_all

    x = torch.randn(1, L, D, requires_grad=True)
    out = []
    for h in halo_sizes:
        row = {}
        for name, fn in (("p2p", torch_impl.gather_halo), ("all_to_all", halo_all_to_all)):
            with PayloadCounter() as counted:
                fn(x, group, h, layout=layout).sum().backward()
            row[name] = counted.received
        if not compiled:
            out.append(row)
            continue
        step = torch.compile(
            lambda x, h=h: torch_impl.gather_halo(x, group, h), backend="aot_eager", fullgraph=True
        )
        step(x).sum().backward()  # compiles
        dist.barrier(group)
        before = wire_bytes()[0]
        step(x).sum().backward()
        row["compiled_wire"] = wire_bytes()[0] - before
        dist.barrier(group)
        out.append(row)
    return out


def state(group, configs):
    """gather_state on this rank's maps: config A, B (device order: rank r's k maps at rows r*k ..),
    dtype, layout, cotangents (per rank) -> per config the states, the gradients of A and B, whether
    an input was mutated, and the bytes received per direction (counted at the c10d calls)."""
    from cp_support.traffic import PayloadCounter

    n, r, out = dist.get_world_size(group), dist.get_rank(group), []
    for c in configs:
        k = c["A"].shape[1] // n
        A, B = (
            torch.from_numpy(np.ascontiguousarray(c[name][:, r * k : (r + 1) * k])).to(DTYPES[c["dtype"]])
            for name in ("A", "B")
        )
        A.requires_grad_(True), B.requires_grad_(True)
        before = (A.detach().clone(), B.detach().clone())
        with PayloadCounter() as counter:
            counter.tag = ("forward",)
            y = torch_impl.gather_state(A, B, group, layout=c["layout"])
            counter.tag = ("backward",)
            if y.requires_grad:  # not without CP under contiguous: zeros
                y.backward(torch.from_numpy(c["cotangents"][r]).to(y.dtype))
        received = {}
        for call in counter.log:
            received[call.tag[0]] = received.get(call.tag[0], 0) + call.received
        out.append(
            {
                "y": y.detach().clone(),
                "grads": tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (A, B)),
                "mutated": not (torch.equal(A.detach(), before[0]) and torch.equal(B.detach(), before[1])),
                "received": received,
            }
        )
    return out


def bad_state(group, calls):
    """Each (A shape, B shape, dtype of B, layout, validate, per-rank B width or None) must raise
    ValueError on every rank before the state moves; returns the messages, then a good gather's."""
    messages = []
    for a_shape, b_shape, b_dtype, layout, validate, widths in calls:
        if widths is not None:
            b_shape = (*b_shape[:-1], widths[dist.get_rank(group)])
        A, B = torch.zeros(a_shape), torch.zeros(b_shape, dtype=DTYPES[b_dtype])
        try:
            torch_impl.gather_state(A, B, group, layout=layout, validate=validate)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    y = torch_impl.gather_sequence(torch.full((1, 2, 3), dist.get_rank(group) + 1.0), group)
    return messages, y[0, :, 0].tolist()


def reductions(group, configs):
    """torch_impl's reductions on this rank's shard: config x [B, n*L, ...] and mask [B, n*L] in
    device order, position [B], dtype, layout, cotangents (per rank, of sum_sequence's and
    select_position's outputs) -> per config the three outputs, x's gradient, whether an input was
    mutated, and the bytes received per direction (counted at the c10d calls)."""
    from cp_support.traffic import PayloadCounter

    n, r, out = dist.get_world_size(group), dist.get_rank(group), []
    for c in configs:
        L = c["x"].shape[1] // n
        x = local_shard(c["x"], group, c["dtype"]).requires_grad_(True)
        mask = torch.from_numpy(np.ascontiguousarray(c["mask"][:, r * L : (r + 1) * L]))
        position = torch.from_numpy(c["position"])
        before = (x.detach().clone(), mask.clone(), position.clone())
        with PayloadCounter() as counter:
            counter.tag = "forward"
            total = torch_impl.sum_sequence(x, group, mask)
            picked = torch_impl.select_position(x, position, group, layout=c["layout"])
            last = torch_impl.last_position(mask, group, layout=c["layout"])
            counter.tag = "backward"
            cts = [torch.from_numpy(ct[r]).to(x.dtype) for ct in c["cotangents"]]
            torch.autograd.backward([total, picked], cts)
        received = {}
        for call in counter.log:
            received[call.tag] = received.get(call.tag, 0) + call.received
        after = (x.detach(), mask, position)
        out.append(
            {
                "sum": total.detach(),
                "select": picked.detach(),
                "last": last,
                "grad": x.grad,
                "mutated": not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                "received": received,
            }
        )
    return out


def bad_reductions(group, calls):
    """Each (function, x shape, x dtype, mask/position, validate) call's ValueError message (None if
    it raised none), then a sum over the group: no rank was left waiting."""
    messages = []
    for function, shape, dtype, extra, validate in calls:
        x = torch.ones(shape, dtype=DTYPES[dtype])
        try:
            if function == "sum_sequence":
                torch_impl.sum_sequence(x, group, extra, validate=validate)
            elif function == "select_position":
                torch_impl.select_position(x, extra, group, validate=validate)
            else:
                torch_impl.last_position(x, group, layout=extra, validate=validate)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages, torch_impl.sum_sequence(torch.ones(1, 1), group).item()
