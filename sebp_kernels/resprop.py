"""ReSprop: reuse the previous step's output gradient and compute only a sparse correction.

The premise (Goli & Aamodt, CVPR 2020): output gradients of consecutive training steps are strongly
correlated. Whether they are for a given model and data is what :func:`reuse_drop` (and
``sebp_probe.ReuseDropCollector`` over a few steps) measures. A layer keeps P (T, out): the previous training backward's dL/dY of one sample over its positions. This backward
approximates dY[b, t] ~ P[t] + D[b, t], D = dY - P, keeping only the rows of D with the largest norms
(``reuse = 0.9`` keeps the top 10% of the active rows):

    dX = A * (P W)  +  D_kept W            (P W is one (T, in) product, broadcast over the batch)
    dW = Pᵀ ΣX      +  D_keptᵀ X_kept      (ΣX[t] = sum over b of the active rows' X[b, t])
    db = sum of dY                         (exact: it is cheap)

A row is *active* when dY holds a non-zero there (NaN and Inf count); inactive rows (padding, rows no loss
reaches) stay inactive: A masks P there and they never enter D_kept. Rows with NaN/Inf in dY are always
kept, so a diverging run shows in every gradient. The D_kept part runs through the SEBP row-gather backward
(the torch reference on CPU, the Triton kernels on CUDA, given the kept rows as a permutation and a
device-side count): no host synchronisation on the GPU.

P is aligned by position index: truncated, or zero-extended where the previous batch was shorter (there
P = 0, so D = dY and those rows are kept first). That suits right padding; under left padding real tokens
of batches of different lengths sit at different indices and reuse works less well (the gradients stay
correct approximations: D absorbs the difference). Inputs are (*batch, T, in): a 2-D input has no
position axis and is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import BACKENDS, SEBPConfig
from .functional import linear_grads, resolve_backend, sebp_linear
from .modules import plain_linear, with_parameters_of
from .reference import backward_over_rows, records_grad, sebp_backward_torch

KEEP_SCALE = 1_000_000  # reuse is taken to 6 decimals: the kept count is integer arithmetic on the device
DEFAULT_LEVELS: tuple[float, ...] = (0.5, 0.7, 0.9, 0.95, 0.99)


def check_reuse(reuse: float) -> float:
    """``reuse`` as a float in [0, 1], or a one-line error."""
    if isinstance(reuse, bool) or not isinstance(reuse, (int, float)) or not 0 <= reuse <= 1:
        raise ValueError(f"reuse must be a number in [0, 1] (the share of rows whose correction is dropped), "
                         f"got {reuse!r}")
    return float(reuse)


def kept_count(reuse: float, active: torch.Tensor) -> torch.Tensor:
    """ceil((1 - reuse) * number of active rows), as an int64 tensor on ``active``'s device (no sync)."""
    keep = round((1 - reuse) * KEEP_SCALE)
    return (active.sum() * keep + (KEEP_SCALE - 1)) // KEEP_SCALE


class ReSpropState:
    """One layer's P, the dL/dY of one sample of its last training backward (T, out), or None.

    ``generation`` grows with every :meth:`reset`: a backward whose forward ran before a reset neither uses
    nor stores P. Copies (deepcopy, pickle) start empty.
    """

    __slots__ = ("p", "generation", "updates")

    def __init__(self) -> None:
        self.p: torch.Tensor | None = None
        self.generation = 0
        self.updates = 0  # backwards that stored P since the last reset (tests and diagnostics)

    def __reduce__(self):
        return (ReSpropState, ())

    def reset(self) -> None:
        self.p = None
        self.generation += 1
        self.updates = 0

    def usable(self, dy: torch.Tensor) -> torch.Tensor | None:
        """P if it fits ``dy`` (width, dtype, device), else None (the next backward is exact)."""
        p = self.p
        if p is None or p.shape[-1] != dy.shape[-1] or p.dtype != dy.dtype or p.device != dy.device:
            return None
        return p


def align(p: torch.Tensor, t: int) -> torch.Tensor:
    """P (T', out) over ``t`` positions: truncated, or zero-extended (P unknown there)."""
    if p.shape[0] >= t:
        return p[:t]
    return F.pad(p, (0, 0, 0, t - p.shape[0]))


def reuse_source(dy: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """The next P from dL/dY (B, T, out): the sample with the most active rows (so that P is known at as many
    positions as possible; the first such sample on ties), its non-finite rows zeroed (P unknown there: a NaN
    in P would spread to every row at its position next step). A new tensor, no host sync."""
    active = dy.any(-1) if active is None else active
    best = active.sum(1).argmax().reshape(1)
    p = dy.index_select(0, best).squeeze(0)
    return p.masked_fill(~torch.isfinite(p).all(-1, keepdim=True), 0)


def row_norms(d2: torch.Tensor) -> torch.Tensor:
    """Norms of the rows of ``d2`` (M, n), in float32 or wider (float64 input stays float64)."""
    return torch.linalg.vector_norm(d2, dim=1, dtype=torch.promote_types(d2.dtype, torch.float32))


def _scores(d2: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Row norms of D for ranking (fp32 or wider): non-finite rows +inf (always first), inactive rows -1 (never
    kept)."""
    s = row_norms(d2)
    s = s.masked_fill(~torch.isfinite(s), math.inf)
    return s.masked_fill(~active, -1.0)


def keep_mask(d2: torch.Tensor, active: torch.Tensor, reuse: float) -> torch.Tensor:
    """Boolean (M,): the rows of D (M, out) whose correction is computed: the ceil((1 - reuse) * active)
    largest-norm active rows, plus every row holding NaN/Inf. Stable ranks (ties: the lower row first)."""
    scores = _scores(d2, active)
    order = torch.argsort(scores, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (rank < kept_count(reuse, active)) | (scores == math.inf)


def _kept_products(d2, x2, weight, keep, backend, need_dx, need_dw):
    """(dX rows, dW) of D over the kept rows only, through the SEBP row-gather backward of ``backend``."""
    config = SEBPConfig("exact", backend=backend)
    impl = resolve_backend(config, d2.device)
    if impl is not sebp_backward_torch:
        from ._triton.backward import supported

        if supported(d2, x2 if need_dw else None, weight):
            # the kept rows first (in row order), then the others; the count stays on the device
            perm = torch.sort((~keep).to(torch.uint8), stable=True).indices.to(torch.int32)
            count = keep.sum(dtype=torch.int32).reshape(1)
            dx, dw, _ = impl(d2, x2, weight, config, need_dx, need_dw, False, rows=(perm, count))
            return dx, dw
    dx, dw, _ = backward_over_rows(d2, x2, weight, keep.nonzero().squeeze(1), need_dx, need_dw, False)
    return dx, dw


def resprop_grads(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    p: torch.Tensor | None,
    reuse: float,
    backend: str = "auto",
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(dX (*, T, in), dW, db, next P) of ``Y = X Wᵀ + b`` by ReSprop; None where not needed.

    ``dy`` (*, T, out); ``x`` (*, T, in), None when dW is not needed; ``p`` the layer's P (T', out) or None.
    With no P (the first step after a reset) or ``reuse == 0`` this is the exact SEBP backward. The next P is
    None when ``reuse == 0`` (nothing to keep) or ``dy`` is empty.
    """
    t, n_out = dy.shape[-2], dy.shape[-1]
    out_shape = (*dy.shape[:-1], weight.shape[1])
    if dy.numel() == 0 or reuse == 0:
        p, next_p = None, None
    else:
        dy3 = dy.reshape(-1, t, n_out)
        active = dy3.any(-1)
        next_p = reuse_source(dy3, active)
    if p is None:
        dx, dw, db = linear_grads(dy, x, weight, SEBPConfig("exact", backend=backend), need_dx, need_dw, need_db)
        return (dx.view(out_shape) if dx is not None else None), dw, db, next_p
    pa = align(p, t)
    mask = active.unsqueeze(-1).to(dy.dtype)
    d = torch.empty(dy3.shape, dtype=dy.dtype, device=dy.device)  # row-major whatever dY's strides
    d2 = torch.addcmul(dy3, mask, pa, value=-1, out=d).view(-1, n_out)  # D, zero on inactive rows
    keep = keep_mask(d2, active.reshape(-1), reuse)
    x3 = x.reshape(-1, t, x.shape[-1]) if need_dw else None
    dx, dw = _kept_products(d2, x3.reshape(-1, x.shape[-1]) if need_dw else None, weight, keep, backend,
                            need_dx, need_dw)
    if need_dx:
        dx = dx.view(-1, t, weight.shape[1]).addcmul_(mask, pa @ weight).view(out_shape)
    if need_dw:
        sum_x = torch.einsum("bt,bti->ti", mask.squeeze(-1).to(x3.dtype), x3)  # ΣX over active rows
        dw = dw.addmm_(pa.t(), sum_x)
    db = dy3.reshape(-1, n_out).sum(0, dtype=torch.float32).to(dy.dtype) if need_db else None
    return dx, dw, db, next_p


class ReSpropFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state, reuse, backend):
        ctx.state, ctx.reuse, ctx.backend, ctx.generation = state, reuse, backend, state.generation
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        state = ctx.state
        current = state.generation == ctx.generation  # no reset (train/eval switch, load) since the forward
        p = state.usable(dy) if current else None
        dx, dw, db, next_p = resprop_grads(dy, x, weight, p, ctx.reuse, ctx.backend, need_dx, need_dw, need_db)
        if current and next_p is not None:
            state.p = next_p
            state.updates += 1
        return dx, dw, db, None, None, None


def resprop_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: ReSpropState,
                   reuse: float, backend: str = "auto") -> torch.Tensor:
    """``F.linear`` whose backward is ReSprop over ``state`` (read and updated by the backward).

    Where autograd records nothing it is ``F.linear`` itself. Under autocast the inputs are cast as autocast
    casts ``F.linear`` (as :func:`~sebp_kernels.sebp_linear` does); P then has the autocast dtype.
    """
    if not records_grad(x, weight, bias):
        return F.linear(x, weight, bias)
    if x.dim() < 3:  # rows without a position axis (e.g. the gathered rows of a last layer): nothing to align P
        return sebp_linear(x, weight, bias)  # with: the exact SEBP backward, and P stays as it was
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype != torch.float64:
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return ReSpropFunction.apply(x, weight, bias, state, reuse, backend)
    return ReSpropFunction.apply(x, weight, bias, state, reuse, backend)


class ReSpropLinear(nn.Linear):
    """Drop-in nn.Linear with the ReSprop backward in training mode (see the module docstring).

    Build it with :meth:`from_linear` to share Parameters (state_dict keys unchanged). In evaluation mode it
    is a plain linear. P is reset when the module switches between training and evaluation, when a
    state_dict is loaded into it, and by :meth:`reset_resprop`; it is never saved, so the first backward
    after a reset or a resume is exact. P costs T x out elements of dY's dtype per layer.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, reuse: float = 0.9,
                 backend: str = "auto"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.reuse = reuse
        if backend not in BACKENDS:
            raise ValueError(f"unknown SEBP backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self._resprop_backend = backend
        self._resprop = ReSpropState()

    @property
    def reuse(self) -> float:
        """Share of active rows whose correction D is dropped (0: exact SEBP)."""
        return self._resprop_reuse

    @reuse.setter
    def reuse(self, value: float) -> None:
        self._resprop_reuse = check_reuse(value)

    @property
    def resprop_state(self) -> ReSpropState:
        return self._resprop

    @classmethod
    def from_linear(cls, linear: nn.Linear, reuse: float = 0.9, backend: str = "auto") -> "ReSpropLinear":
        """A ReSpropLinear holding *the same* Parameter objects as the plain nn.Linear ``linear``."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"expected a plain nn.Linear, got {type(linear).__name__}")
        return with_parameters_of(linear, lambda: cls(linear.in_features, linear.out_features,
                                                      bias=linear.bias is not None, reuse=reuse, backend=backend))

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the same Parameters."""
        return plain_linear(self)

    def reset_resprop(self) -> None:
        """Forget P: the next training backward is exact."""
        self._resprop.reset()

    def train(self, mode: bool = True) -> "ReSpropLinear":
        if mode != self.training:
            self._resprop.reset()
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        self._resprop.reset()  # new weights (a resume): the old gradients are no reference any more
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        return resprop_linear(x, self.weight, self.bias, self._resprop, self._resprop_reuse, self._resprop_backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reuse={self._resprop_reuse:g}"


@dataclass
class ReuseDrop:
    """What ReSprop at each reuse level would drop of one layer's dL/dY, given the previous step's.

    ``dropped[i]``: ||D over the dropped rows|| / ||dY|| at ``levels[i]`` (Frobenius norms), the relative error
    of the approximated dY. ``topk_dropped[i]``: the same share of rows dropped from dY itself (SEBP topk
    without reuse), for comparison. ``residual``: ||D|| / ||dY||, the error of reusing P alone (reuse 1).
    NaN where dY holds NaN/Inf.
    """

    levels: tuple[float, ...]
    dropped: list[float]
    topk_dropped: list[float]
    residual: float
    active_rows: int


def _dropped_norms(scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """sqrt of the summed squares of all but the ``kept[i]`` largest ``scores`` (inactive rows score -1)."""
    sq = scores.double().clamp_min(0).square().sort(descending=True).values
    cum = torch.cat([sq.new_zeros(1), sq.cumsum(0)])
    return (cum[-1] - cum[kept]).clamp_min(0).sqrt()


def drop_stats(p: torch.Tensor | None, dy: torch.Tensor, levels=DEFAULT_LEVELS) -> torch.Tensor:
    """float64 tensor [dropped per level, topk_dropped per level, residual, active rows] on ``dy``'s device
    (no sync); ``p`` the P of the previous step (None: zero), ``dy`` (*, T, out). See :class:`ReuseDrop`."""
    t, n_out = dy.shape[-2], dy.shape[-1]
    dy3 = dy.reshape(-1, t, n_out)
    active = dy3.any(-1)
    pa = align(p, t) if p is not None else dy3.new_zeros(t, n_out)
    d2 = torch.addcmul(dy3, active.unsqueeze(-1).to(dy.dtype), pa, value=-1).reshape(-1, n_out)
    a = active.reshape(-1)
    kept = torch.stack([kept_count(check_reuse(r), a) for r in levels])
    d_scores = row_norms(d2).masked_fill(~a, -1)
    y_scores = row_norms(dy3.reshape(-1, n_out)).masked_fill(~a, -1)
    total = y_scores.double().clamp_min(0).square().sum().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    d_total = d_scores.double().clamp_min(0).square().sum().sqrt()
    return torch.cat([_dropped_norms(d_scores, kept) / total, _dropped_norms(y_scores, kept) / total,
                      (d_total / total).reshape(1), a.sum().double().reshape(1)])


def reuse_drop(prev_dy: torch.Tensor, dy: torch.Tensor, levels=DEFAULT_LEVELS) -> ReuseDrop:
    """What ReSprop would drop of ``dy`` (*, T, out) at each reuse level, with P taken from ``prev_dy`` (the
    same layer's dL/dY of the step before) by the layer's own rule (:func:`reuse_source`)."""
    levels = tuple(levels)
    v = drop_stats(reuse_source(prev_dy.reshape(-1, *prev_dy.shape[-2:])), dy, levels).tolist()
    n = len(levels)
    return ReuseDrop(levels, v[:n], v[n:2 * n], v[2 * n], int(v[2 * n + 1]))
