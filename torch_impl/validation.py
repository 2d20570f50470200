"""Input checks: each rank's own arguments, and (opt-in) agreement across the CP ranks.

Local checks run on every call and raise `ValueError` before any communication.

Cross-rank validation (`validate=True`, or the environment variable CP_TRANSPORT_VALIDATE=1 for
every call that leaves `validate` as None) first exchanges each rank's signature in one all-gather
of a few int64s: the function called, and x's ndim, shape, dtype and device type, halo_size and
lookahead (a checksum when one per chunk), left_padding and the layout, and whether the rank's
own checks passed. Ranks that disagree on anything but left_padding (a local padding that may differ per
rank) raise `ValueError` on every rank, naming them and their values, where the transport would
otherwise hang or return garbage; a rank whose own arguments are wrong raises its own error after
the exchange, and its peers raise one naming it.
Turn it on while developing or debugging a CP setup; it costs one tiny collective per call. It is
skipped inside torch.compile (it reads the exchanged values on the host).
"""

import os
import zlib

import torch
import torch.distributed as dist

from torch_impl import _group
from torch_impl import layout as layouts

ENV_VAR = "CP_TRANSPORT_VALIDATE"
_FUNCTIONS = (
    "gather_sequence",
    "gather_halo",
    "gather_metadata",
    "gather_state",
    "sum_sequence",
    "select_position",
    "last_position",
)
_MAX_DIMS = 8  # shape dims sent as they are; any beyond are folded into one checksum
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "privateuseone")


def check_shard(x):
    """x must be [batch, local_sequence, ...]."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"`x` must be [batch, local_sequence, ...] (ndim >= 2), got shape {tuple(x.shape)}")


def check_count(name, value):
    """A token count: a non-negative Python int (bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")


def check_halo_size(halo_size, layout, world_size, name="halo_size"):
    """One count for every chunk, or one per global chunk of the layout (n, or 2n under head_tail)."""
    if not isinstance(halo_size, (tuple, list)):
        check_count(name, halo_size)
        return
    for h in halo_size:
        check_count(name, h)
    chunks = world_size if layout == "contiguous" else 2 * world_size
    if len(halo_size) != chunks:
        raise ValueError(
            f"`{name}` must be a non-negative int or one per global chunk ({chunks} for "
            f"layout={layout!r} over {world_size} ranks), got {halo_size!r}"
        )


def check_state(maps, layout):
    """gather_state's (A, B): A [batch, k, ..., m, m], B [batch, k, ..., m, p], k the layout's local
    chunks (1; 2 under head_tail), one dtype and device."""
    A, B = maps
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"`{name}` must be a floating-point torch.Tensor, got {getattr(t, 'dtype', type(t))}"
            )
    layouts.check(layout)
    k = 1 if layout == "contiguous" else 2
    if A.dim() < 4 or A.shape[1] != k or A.shape[-1] != A.shape[-2]:
        raise ValueError(
            f"`A` must be [batch, {k}, ..., m, m] (one square map per local chunk of layout={layout!r}), "
            f"got shape {tuple(A.shape)}"
        )
    if B.shape[:-1] != A.shape[:-1] or B.dtype != A.dtype or B.device != A.device:
        raise ValueError(
            f"`B` must be [{', '.join(map(str, A.shape[:-1]))}, p] on A's dtype and device ({A.dtype}, "
            f"{A.device}), got {tuple(B.shape)} {B.dtype} {B.device}"
        )


def check_reduction(function, x, mask=None, position=None):
    """The reductions' own arguments (torch_impl.reductions): x's tokens a mask or numbers, and a
    bool mask [B, L] or one integer position per row [B] beside them."""
    if function == "last_position" and x.dtype != torch.bool:
        raise ValueError(f"`mask` must be a bool tensor [batch, local_sequence], got {x.dtype}")
    if function != "last_position" and x.dtype == torch.bool:
        raise ValueError(f"`x` must hold numbers, not bool, in {function}; pass x.long() to count")
    if mask is not None and (
        not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != x.shape[:2]
    ):
        raise ValueError(
            f"`mask` must be a bool tensor of x's [batch, local_sequence] = {tuple(x.shape[:2])}, got "
            f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}"
        )
    if function == "select_position" and (
        not isinstance(position, torch.Tensor)
        or position.dtype.is_floating_point
        or position.dtype == torch.bool
        or position.shape != x.shape[:1]
    ):
        raise ValueError(
            f"`position` must be an integer tensor [batch] = [{x.shape[0]}] (a global position per row), "
            f"got {getattr(position, 'dtype', type(position).__name__)} "
            f"{tuple(getattr(position, 'shape', ()))}"
        )


def check_local(
    function,
    x,
    halo_size=None,
    left_padding=None,
    layout="contiguous",
    world_size=1,
    lookahead=0,
    **reduction,
):
    if function == "gather_state":
        check_state(x, layout)
        return
    check_shard(x)
    layouts.check(layout, x.shape[1])
    if function in ("sum_sequence", "select_position", "last_position"):
        check_reduction(function, x, **reduction)
    if function == "gather_halo":
        check_halo_size(halo_size, layout, world_size)
        check_halo_size(lookahead, layout, world_size, "lookahead")
        check_count("left_padding", left_padding)
    if function == "gather_metadata" and x.requires_grad:
        raise ValueError(
            "`x` must not require grad in gather_metadata (it has no backward); "
            "use gather_sequence for differentiable tensors, or pass x.detach()"
        )


def enabled(validate):
    if validate is None:
        return os.environ.get(ENV_VAR, "0").lower() in ("1", "true", "yes", "on")
    return bool(validate)


def check(
    function,
    group,
    validate,
    x,
    halo_size=None,
    left_padding=None,
    layout="contiguous",
    lookahead=0,
    **reduction,
):
    """The local checks, preceded, when validation is on and there is CP, by the cross-rank one.
    `reduction`: the reductions' mask or position (check_reduction)."""
    n = _group.world_size(group)
    if not enabled(validate) or n == 1 or torch.compiler.is_compiling():
        check_local(function, x, halo_size, left_padding, layout, n, lookahead, **reduction)
        return
    try:
        check_local(function, x, halo_size, left_padding, layout, n, lookahead, **reduction)
        error = None
    except ValueError as e:
        error = e
    fields = encode(function, x, halo_size, left_padding, layout, lookahead)
    failed, groups, rows = _compare(error is None, fields, x, group, local=("left_padding",))
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{function}: CP ranks {failed} rejected their own arguments (see the error on those ranks)"
        )
    if len(groups) > 1:
        details = "; ".join(
            f"{_ranks(ranks)}: {_describe(decode(rows[ranks[0]][1:]))}"
            for ranks in sorted(groups.values(), key=len)
        )
        raise ValueError(f"{function}: CP ranks disagree on their inputs ({details})")


def compare_ranks(ok, fields, x, group):
    """Every rank's own verdict and its named int `fields`, in one all-gather of int64s: returns
    (the ranks whose own check failed, i.e. `ok` False on them; a description of how the ranks'
    fields differ, or None when they all agree). For checks that only some ranks can fail, or
    inputs that must agree, so that every rank can raise instead of leaving its peers waiting in
    the next collective. x: any tensor of the rank's, for the device."""
    failed, groups, _ = _compare(ok, fields, x, group)
    if len(groups) == 1:
        return failed, None
    details = "; ".join(
        f"{_ranks(ranks)}: "
        + ", ".join(f"{name}={value}" for name, value in zip(fields, values, strict=True))
        for values, ranks in sorted(groups.items(), key=lambda item: item[1])
    )
    return failed, details


# --- the wire format: one int64 per named field, encoded and decoded here -----------------------

FIELDS = (
    "function",  # index in _FUNCTIONS
    "ndim",
    "dtype",  # _code(str(dtype))
    "device",  # _code(device type)
    "halo_size",  # -1 where the call has none, -2 where it is one per chunk
    "halo_sizes",  # a checksum of the per-chunk halo sizes, -1 where there are none
    "left_padding",
    "layout",  # index in torch_impl.layout.LAYOUTS, -1 if unknown
    "lookahead",  # gather_halo's, as halo_size
    "lookaheads",
    *(f"dim{i}" for i in range(_MAX_DIMS)),  # the shape; -1 past ndim; a checksum of any dims beyond
)


def encode(function, x, halo_size, left_padding, layout, lookahead=0):
    """{field: int} for one call (FIELDS), whatever its arguments (a rank whose own are wrong still
    sends its signature, so that its peers can name it). gather_state's (A, B) is described as the
    buffer it sends: [..., m, m + p]."""
    shape = None
    if isinstance(x, tuple) and all(isinstance(t, torch.Tensor) and t.dim() for t in x):
        shape = [*x[0].shape[:-1], x[0].shape[-1] + x[1].shape[-1]]
    x = x[0] if isinstance(x, tuple) and x else x
    tensor = isinstance(x, torch.Tensor)
    shape = shape if shape is not None else list(x.shape) if tensor else []
    dims = shape[:_MAX_DIMS] + [-1] * (_MAX_DIMS - len(shape))
    if len(shape) > _MAX_DIMS:
        dims[-1] = _code(str(shape[_MAX_DIMS - 1 :]))

    def count(v):
        return v if isinstance(v, int) and not isinstance(v, bool) else -1

    values = [
        _FUNCTIONS.index(function),
        x.dim() if tensor else -1,
        _code(str(x.dtype)) if tensor else -1,
        _code(x.device.type) if tensor else -1,
        -2 if isinstance(halo_size, (tuple, list)) else count(halo_size),
        _code(str(list(halo_size))) if isinstance(halo_size, (tuple, list)) else -1,
        count(left_padding),
        layouts.LAYOUTS.index(layout) if layout in layouts.LAYOUTS else -1,
        -2 if isinstance(lookahead, (tuple, list)) else count(lookahead),
        _code(str(list(lookahead))) if isinstance(lookahead, (tuple, list)) else -1,
        *dims,
    ]
    return dict(zip(FIELDS, values, strict=True))


def decode(values):
    """A signature's fields by name, from the values in FIELDS order."""
    return dict(zip(FIELDS, values, strict=True))


def _code(text):
    return zlib.crc32(text.encode()) & 0x7FFFFFFF  # the same in every process, unlike hash()


def _ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _compare(ok, fields, x, group, local=()):
    """All-gather [ok, *fields.values()] from every rank: (the ranks that sent ok False, the ranks
    grouped by their values of the fields that must agree (all but `local`, which may differ per
    rank), every rank's row)."""
    rows = _exchange([int(ok), *fields.values()], x, group)
    failed = [r for r, row in enumerate(rows) if not row[0]]
    names, groups = list(fields), {}
    for r, row in enumerate(rows):
        agreed = tuple(v for name, v in zip(names, row[1:], strict=True) if name not in local)
        groups.setdefault(agreed, []).append(r)
    return failed, groups, rows


def _exchange(values, x, group):
    """Every rank's values, in group-rank order: one all_gather_single of int64s."""
    x = x[0] if isinstance(x, tuple) and x else x
    if isinstance(x, torch.Tensor):
        device = x.device
    else:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        )
    mine = torch.tensor(values, dtype=torch.int64, device=device)  # [K]
    rows = mine.new_empty((_group.world_size(group) * mine.numel(),))  # [n*K]
    _group.all_gather_single(rows, mine, group=group)
    return rows.view(-1, mine.numel()).tolist()  # [n][K]


def _describe(fields):
    dtypes = {
        _code(str(v)): str(v).removeprefix("torch.")
        for v in vars(torch).values()
        if isinstance(v, torch.dtype)
    }
    devices = {_code(d): d for d in _DEVICE_TYPES}
    ndim = fields["ndim"]
    shown = [fields[f"dim{i}"] for i in range(ndim if ndim <= _MAX_DIMS else _MAX_DIMS - 1)]
    shape = "(" + ", ".join(map(str, shown)) + (", ..." if ndim > _MAX_DIMS else "") + ")"
    dtype, device = dtypes.get(fields["dtype"], "?"), devices.get(fields["device"], "?")
    text = f"{_FUNCTIONS[fields['function']]} of shape {shape} {dtype} on {device}"
    if fields["function"] == _FUNCTIONS.index("gather_halo"):
        halo = fields["halo_size"] if fields["halo_size"] != -2 else f"per chunk #{fields['halo_sizes']:x}"
        text += f", halo_size={halo}, left_padding={fields['left_padding']}"
        if fields["lookahead"]:
            ahead = (
                fields["lookahead"] if fields["lookahead"] != -2 else f"per chunk #{fields['lookaheads']:x}"
            )
            text += f", lookahead={ahead}"
    if fields["layout"] != 0:  # contiguous, the default, goes unsaid
        text += f", layout={layouts.LAYOUTS[fields['layout']] if fields['layout'] > 0 else '?'}"
    return text
