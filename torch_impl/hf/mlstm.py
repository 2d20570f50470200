"""xLSTM's mLSTM cells (transformers' xLSTMBackend), context-parallel through gather_state.

Per head the mLSTM carries a matrix memory C [dk, dv] and a normaliser n [dk]:
C_t = f_t C_{t-1} + i_t k_t v_t^T, n_t = f_t n_{t-1} + i_t k_t, with f_t = sigmoid(f~_t) and an
exponential input gate i_t = exp(i~_t); its output is h_t = C_t^T q_t / max(|n_t . q_t|, 1) (up to
the kernel's eps). Over a chunk the state is an affine map with a scalar decay:
(C, n)_out = F (C, n)_in + (C, n)_B, F = exp(sum of log f_t), (C, n)_B the chunk's final state
from zero, which gather_state folds as Mamba2's ([1 x 1] maps over the dk (dv + 1) entries).

The stabiliser. The kernels hold C, n scaled by exp(-m_t), m_t = max(log f_t + m_{t-1}, i~_t)
(m_0 = 0): a max-plus recurrence, so over a chunk m_out = max(m_in + log F, M) with
M = max_s (i~_s + sum_{u > s} log f_u), computed here from the gates. The chunks' (log F, M) are
all-gathered (gather_sequence: gradients return to their owners) and folded in global order, so
each chunk starts from one process's m exactly (the same max over the same terms), and its output's
eps term, eps exp(m), is one process's too. The true (unscaled) states are folded: |m| stays within
the gates' soft cap (xLSTM's `gate_soft_cap`, 15 by default, bounds i~, and m >= i~), so exp(m) is
far from overflowing; a model without the cap is refused.

Each local chunk runs the module's own kernel twice: from zero (its final state: the map) and from
the state the earlier chunks leave (its outputs). An unsharded call runs the module's forward.
"""

import inspect

import torch
from torch import nn
import torch.nn.functional as F

from torch_impl import _group
from torch_impl.hf._common import RUNNING, stepping_aside
from torch_impl.layout import ShardPlan
from torch_impl.sequence import gather_sequence
from torch_impl.state import gather_state

SIGNATURE = ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial")
LARGEST_CAP = 60.0  # exp(60) ~ 1e26: a true state within float32's range times the stabilised one


def is_mlstm(module: nn.Module) -> bool:
    """Whether `module` is xLSTM's mLSTM backend: a forward taking SIGNATURE (then the mode
    arguments), with the model's config."""
    if not hasattr(getattr(module, "config", None), "gate_soft_cap"):
        return False
    names = tuple(inspect.signature(type(module).forward).parameters)[1:]
    return names[: len(SIGNATURE)] == SIGNATURE


def check_mlstm(module: nn.Module) -> str | None:
    """Why an mLSTM backend cannot be made CP, or None."""
    config = module.config
    cap = config.gate_soft_cap
    if cap is None or cap > LARGEST_CAP:
        return (
            f"is an mLSTM whose input gates are not soft-capped within {LARGEST_CAP} (gate_soft_cap={cap}): "
            "its true state, which CP folds across ranks, could overflow"
        )
    if config.mode == "train_with_padding":
        return "is an mLSTM in mode 'train_with_padding', whose kernel returns no final state"
    return None


class MLSTMState:
    """The module's forward over each local chunk, from the state the earlier chunks leave."""

    def __init__(self, backend, group, layout):
        self.backend, self.group, self.layout = backend, group, layout

    def own(self, q, k, v, i, f, state=(None, None, None)):
        """The module's own forward over [B, NH, C, ...] inputs: (h, (c, n, m))."""
        c, n, m = state
        return type(self.backend).forward(
            self.backend, q, k, v, i, f, c_initial=c, n_initial=n, m_initial=m, return_last_states=True
        )

    def __call__(
        self, query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None, **kwargs
    ):
        context = RUNNING.context
        # an unsharded call (or without CP, one recomputed outside the forward): the module's own
        if stepping_aside() or (self.group is None and context is None):
            forward = type(self.backend).forward
            return forward(
                self.backend, query, key, value, igate, fgate, c_initial, n_initial, m_initial, **kwargs
            )
        if any(s is not None for s in (c_initial, n_initial, m_initial)):
            raise ValueError(
                "torch_impl.hf: an mLSTM layer was called with a recurrent state: generation with a cache "
                "is not supported under CP"
            )
        if getattr(context, "documents", None) is not None:
            raise ValueError(
                "torch_impl.hf: an mLSTM layer was given packed documents (isolate_documents=True): it "
                "does not keep them apart; pass unpacked rows"
            )
        # query, key: [B, NH, L, dk]; value: [B, NH, L, dv]; igate, fgate: [B, NH, L]
        n, r, L = _group.world_size(self.group), _group.rank(self.group), query.shape[2]
        dk, dv = query.shape[-1], value.shape[-1]
        windows = ShardPlan.of(self.layout, n, r, L).windows(0)
        config, C = self.backend.config, windows[0].end - windows[0].start
        if "train" in config.mode and C % config.chunk_size:
            raise ValueError(
                f"torch_impl.hf: an mLSTM in mode {config.mode!r} runs its chunkwise kernel over each local "
                f"chunk, whose length ({C} tokens) must be a multiple of its chunk_size ({config.chunk_size})"
            )
        decays, maps, maxima = [], [], []
        fold = torch.promote_types(fgate.dtype, torch.float32)  # gates and states folded in at least float32
        for w in windows:
            rows = (slice(None), slice(None), w.queries)
            _, (c, nb, m) = self.own(query[rows], key[rows], value[rows], igate[rows], fgate[rows])
            kept = c.dtype, m.dtype  # the dtypes the kernel keeps its states in
            scale = m.to(fold).exp()  # [B, NH, 1]: the kernel's states are the true ones over exp(m)
            true = torch.cat([(c.to(fold) * scale[..., None]).flatten(-2), nb.to(fold) * scale], dim=-1)
            maps.append(true[:, :, None])  # [B, NH, 1, dk (dv + 1)]
            log_f = F.logsigmoid(fgate[rows].to(fold)).cumsum(dim=-1)  # [B, NH, C]: to each token, inclusive
            decays.append(log_f[..., -1:, None].exp())  # [B, NH, 1, 1]: F
            top = (igate[rows].to(fold) - log_f).amax(dim=-1) + log_f[..., -1]  # [B, NH]: M
            maxima.append(torch.stack([log_f[..., -1], top], dim=-1))  # [B, NH, 2]
        # [B, k, NH, 1, dk (dv + 1)]: the true state each local chunk starts from
        states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), self.group, layout=self.layout)
        stabilisers = self.fold(torch.stack(maxima, 1))  # [B, k, NH]
        out = []
        for j, w in enumerate(windows):
            rows = (slice(None), slice(None), w.queries)
            m = stabilisers[:, j, :, None]  # [B, NH, 1]
            true = (states[:, j, :, 0] * (-m).exp()).to(kept[0])  # [B, NH, dk (dv + 1)], scaled as kept
            start = (true[..., : dk * dv].unflatten(-1, (dk, dv)), true[..., dk * dv :], m.to(kept[1]))
            h, _ = self.own(query[rows], key[rows], value[rows], igate[rows], fgate[rows], start)
            out.append(h)  # [B, NH, C, dv]
        return (out[0] if len(out) == 1 else torch.cat(out, dim=2)), None

    def fold(self, maxima):
        """maxima [B, k, NH, 2]: each local chunk's (log F, M); the stabiliser m each starts from,
        [B, k, NH], folded over every chunk in global order from m_0 = 0."""
        n, r = _group.world_size(self.group), _group.rank(self.group)
        every = gather_sequence(maxima, self.group, layout=self.layout) if n > 1 else maxima  # [B, N, NH, 2]
        m = [torch.zeros_like(every[:, 0, :, 0])]  # [B, NH] each
        for c in range(every.shape[1] - 1):
            m.append(torch.maximum(m[-1] + every[:, c, :, 0], every[:, c, :, 1]))
        mine = list(ShardPlan.of(self.layout, n, r, maxima.shape[1]).chunks)
        return torch.stack(m, dim=1)[:, mine]
