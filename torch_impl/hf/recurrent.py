"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo hybrid; Kimi Delta Attention:
Kimi Linear; Mamba2: Nemotron-H, Granite 4.0 H, Falcon-H1, Bamba, Zamba2; Mamba: Jamba, Zamba,
Mamba, Falcon Mamba): the model's own forward, with its two sequence functions made
context-parallel (the diagonal forms, MambaScan and SelectiveScan, in torch_impl.hf.scans). MiniMax's
lightning attention, whose block loop is inline in its forward, is scans.LightningAttention;
RecurrentGemma's recurrent block, an nn.Conv1d and the RG-LRU's scan, scans.ConvModuleHalo and
scans.DiagonalScan.

Such a layer is a causal depthwise conv (kernel K) in front of a chunked linear recurrence whose
state S is [dk, dv] per head. Over a rank's chunk of the sequence the recurrence is an affine map of
the state it starts from, S_out = A S_in + B, and its outputs are o = o_0 + M S_in (o_0: the outputs
from a zero state). One run of the model's own kernel gives all four: values widened by dk zero
columns, initial state [0 | I] ([dk, dv + dk]); the value columns evolve independently, so the
first dv columns are o_0 and B, the last dk are M and A. `gather_state` then gives each chunk its
S_in from the earlier chunks' (A, B) (one all-gather of dk * (dk + dv) values per head and chunk,
whatever the length), and o = o_0 + M S_in. The conv takes its K - 1 preceding inputs by gather_halo.

Nothing global changes: the module's forward is its class's own function, decorators kept, over a
copy of its module's globals in which `causal_conv1d_fn` and the chunked kernel are their CP versions
(torch_impl.hf.chunked: the model's own functions, called over a halo / with the identity state;
torch_impl.hf.rebind makes the copy).
Those are transformers' kernel dispatchers: where flash-linear-attention, causal-conv1d or mamba_ssm
is installed they run that package's kernel, which the widened state and the float32 query are not
verified through, so `refusal` refuses the model naming the package. Checkpoints are unaffected
(the parameters are the module's own). Of the forward's context they read only its packed
documents (Packed): each document's state starts from zero and its conv reads nothing before it.
"""

from collections.abc import Callable
import inspect
import types
from typing import NamedTuple

from torch import nn

from torch_impl.hf import upstream
from torch_impl.hf.cca import CCAHalo, is_cca
from torch_impl.hf.chunked import ChunkState, ConvHalo, Unfused
from torch_impl.hf.mlstm import MLSTMState, check_mlstm, is_mlstm
from torch_impl.hf.rebind import global_loads, kernel_package, rebind
from torch_impl.hf.scans import (
    ConvModuleHalo,
    DiagonalScan,
    LightningAttention,
    MambaScan,
    SelectiveScan,
)

CONV = "causal_conv1d_fn"  # (x [B, C, L], weight [C, K], bias, activation) -> [B, C, L]
# KERNELS and RECURRENCES, the table of the kinds made CP here: at the end
# MiniMax's lightning attention: per head its decay rate and the decays within a block
LIGHTNING = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
# fused kernels a forward tries first (mamba_ssm's conv + scan + norm + projection): under CP they
# would run over the shard alone, so the CP forward takes the model's unfused path
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")


def kernel_of(module: nn.Module) -> str | None:
    """The chunked kernel a linear-attention module's forward calls (a KERNELS key), where it also
    calls CONV with its own `conv1d`; else None."""
    names = global_loads(type(module).forward)
    kernel = next((name for name in KERNELS if name in names), None)
    conv = isinstance(getattr(module, "conv1d", None), nn.Conv1d) and CONV in names
    return kernel if conv else None


def is_short_conv(module: nn.Module) -> bool:
    """Whether `module` is a short convolution (LFM2's gated `Lfm2ShortConv`, Inkling's): a depthwise
    causal `conv` (or `conv1d`) whose forward calls CONV and no chunked kernel (ConvHalo alone
    makes it CP)."""
    conv = getattr(module, "conv", None) or getattr(module, "conv1d", None)
    names = global_loads(type(module).forward)
    return (
        isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and CONV in names
        and not any(name in names for name in KERNELS)
    )


def is_lightning(module: nn.Module) -> bool:
    """Whether `module` is MiniMax's lightning attention (scans.LightningAttention): its decay
    buffers, its projections and its norm, as transformers' MiniMaxLightningAttention has them."""
    parts = ("qkv_proj", "output_gate", "out_proj")
    return all(hasattr(module, name) for name in (*LIGHTNING, "norm", "act_fn", "block_size")) and all(
        isinstance(getattr(module, name), nn.Linear) for name in parts
    )


def is_griffin(module: nn.Module) -> bool:
    """Whether `module` is RecurrentGemma's recurrent block (transformers'
    RecurrentGemmaRecurrentBlock): a causal depthwise `conv_1d` (padding K - 1, its first L outputs
    kept) in front of an RG-LRU `rg_lru` whose `_rnn_scan` runs the diagonal recurrence."""
    conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
    return (
        isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and conv.padding[0] == conv.kernel_size[0] - 1
        and conv.stride[0] == conv.dilation[0] == 1
        and callable(getattr(lru, "_rnn_scan", None))
    )


def is_known(module: nn.Module) -> bool:
    """Whether `module` is a linear-attention module made CP here (a RECURRENCES kind but the short
    conv: xLSTM's mLSTM, torch_impl.hf.mlstm; Zaya's CCA projection, torch_impl.hf.cca; ...)."""
    kind = recurrence_of(module)
    return kind is not None and kind.name != SHORT_CONV


def recurrence_of(module: nn.Module) -> "Recurrence | None":
    """The first RECURRENCES kind that recognises `module`, else None."""
    return next((kind for kind in RECURRENCES if kind.recognise(module)), None)


def apply_recurrent(module: nn.Module, group, layout: str) -> "Recurrence":
    """Run `module` (is_known(module) or is_short_conv(module)) context-parallel; returns its kind."""
    kind = recurrence_of(module)
    kind.apply(module, group, layout)
    return kind


def _rebound(module, group, layout):
    """The module's own forward over the CP versions of its conv and chunked kernel (rebind)."""
    module.forward = types.MethodType(
        rebind(type(module).forward, _cp_functions(module, group, layout)), module
    )


def _griffin(module, group, layout):
    halo = ConvModuleHalo(module.conv_1d, group, layout)
    module.rg_lru._rnn_scan = DiagonalScan(module.rg_lru._rnn_scan, group, layout, halo.packed)


def _restated(name):
    """A kind's refusal where its CP version restates the model's code (torch_impl.hf.upstream):
    why, where the installed release's source is not the one it restates."""

    def why(module):
        changed = upstream.differs(name)
        return None if changed is None else f"is made CP by a restatement of its code: {changed}"

    return why


def _forward(cls):
    """Making a module CP by replacing its forward with `cls(module, group, layout)`."""

    def apply(module, group, layout):
        module.forward = cls(module, group, layout)

    return apply


def _replaced(module) -> list:
    """The global names a conv's or chunked recurrence's forward runs with replaced: its conv, its
    chunked kernel, the fused kernels it tries first."""
    kernel, loads = kernel_of(module), global_loads(type(module).forward)
    scope = inspect.unwrap(type(module).forward).__globals__
    fused = [name for name in FUSED if name in loads and scope.get(name) is not None]
    return [CONV, *([kernel] if kernel is not None else []), *fused]


def _cp_functions(module, group, layout) -> dict:
    """The CP versions of the functions `_replaced(module)` names."""
    scope = inspect.unwrap(type(module).forward).__globals__
    conv = ConvHalo(scope[CONV], group, layout)
    functions = {CONV: conv}
    for name in _replaced(module)[1:]:
        cp = (
            Unfused(scope[name], conv.packed)
            if name in FUSED
            else KERNELS[name][1](scope[name], group, layout)
        )
        functions[name] = cp
    return functions


def refusal(module: nn.Module) -> str | None:
    """Why a conv's or chunked recurrence's forward (kernel_of or is_short_conv) cannot run over
    the CP functions, else None: a kernel package behind its conv or kernel, or a forward rebind
    cannot copy. None for the recurrences whose whole forward or scan is replaced."""
    if kernel_of(module) is None and not is_short_conv(module):
        return None
    scope = inspect.unwrap(type(module).forward).__globals__
    for name in (name for name in _replaced(module) if name not in FUSED):  # (under CP no fused one runs)
        package = kernel_package(scope.get(name))
        if package is not None:
            return (
                f"calls `{name}`, which transformers dispatches to {package}'s kernel, installed here: "
                "CP runs convs and chunked recurrences through transformers' PyTorch functions only "
                f"(the kernel called over a halo and from a widened [0 | I] state), so {package} must "
                "not be installed where this model trains context-parallel"
            )
    try:
        rebind(type(module).forward, dict.fromkeys(_replaced(module)))
    except ValueError as error:
        return str(error)
    return None


KERNELS = {  # chunked kernel -> (the recurrence it computes, its CP version)
    "torch_chunk_gated_delta_rule": ("Gated DeltaNet", ChunkState),
    "chunk_kimi_delta_attention": ("Kimi Delta Attention", ChunkState),
    "mamba2_chunk_scan": ("Mamba2 (SSD)", MambaScan),
    "mamba_selective_scan": ("Mamba (selective scan)", SelectiveScan),
}


class Recurrence(NamedTuple):
    """A kind of recurrent layer or causal conv the adapter makes CP."""

    name: str
    recognise: Callable  # (module) -> bool
    apply: Callable  # (module, group, layout): made CP in place
    path: str  # what its CP forward does (model.cp_transport_paths)
    refusal: Callable | None = None  # (module) -> why it cannot be made exact, or None

    def why(self, module) -> str | None:
        """Why `module`, of this kind, cannot be made exact; None where it can."""
        return self.refusal(module) if self.refusal is not None else None


SHORT_CONV = "short convolution"
CHUNKED = "its own forward, the conv over a halo of kernel - 1 inputs, the chunked kernel from the earlier "
CHUNKED += "chunks' state (gather_state)"
# the first that recognises a module is its kind (the order matters where two would)
RECURRENCES = (
    Recurrence(
        "MiniMax lightning attention",
        is_lightning,
        _forward(LightningAttention),
        "its block loop from zero per chunk, corrected by the earlier chunks' state (gather_state)",
        _restated("torch_impl.hf.scans.LightningAttention"),
    ),
    Recurrence(
        "xLSTM's mLSTM",
        is_mlstm,
        _forward(MLSTMState),
        "its own forward per chunk from zero (its map), then from the earlier chunks' state (gather_state) "
        "and stabiliser (max-plus fold)",
        check_mlstm,
    ),
    Recurrence(
        "Zaya's CCA projection",
        is_cca,
        _forward(CCAHalo),
        "its own forward per chunk over the K hidden states before it (a halo: its q/k convs and delayed "
        "values)",
    ),
    Recurrence("RecurrentGemma's RG-LRU", is_griffin, _griffin, CHUNKED),
    *(
        Recurrence(
            name, lambda module, kernel=kernel: kernel_of(module) == kernel, _rebound, CHUNKED, refusal
        )
        for kernel, (name, _) in KERNELS.items()
    ),
    Recurrence(
        SHORT_CONV,
        is_short_conv,
        _rebound,
        "its own forward, the conv over a halo of kernel - 1 inputs",
        refusal,
    ),
)
