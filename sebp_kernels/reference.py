"""Pure-torch SEBP backward: gather the active rows of dL/dY, run the GEMMs on them, scatter dX.

This is the CPU path, the fallback on GPUs, and the oracle the Triton kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import SEBPConfig


def unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` with unit column stride (the kernels index columns with 32-bit offsets times that stride):
    ``t`` itself when it has it (or one column), else a contiguous copy."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def weight_view(w: torch.Tensor) -> torch.Tensor:
    """A 2-D weight (out, in) as the backward kernels read it: ``w`` itself with unit column stride, or the
    transposed view of a contiguous (in, out) one (a ``Conv1D``'s, :class:`~.modules.SEBPConv1D`), which the dX
    loop reads through its strides as the forward over rows reads W (every offset below ``in * out``, 32-bit
    where the weight has fewer than 2**31 elements); else a contiguous copy."""
    if w.stride(1) == 1 or w.shape[1] == 1:
        return w
    if w.stride(0) == 1 and w.stride(1) == w.shape[0] and w.numel() < 2**31:
        return w
    return w.contiguous()


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on ``tensors`` (grad mode on and one of them requires grad). When it
    will not, the SEBP ops run their plain forward alone: no autograd Function (host time on every call, in
    evaluation and generation too), nothing saved for a backward that never comes, no NaN/Inf flags pass."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def refuse_missing_triton(backend: str, found) -> None:
    """Raise when ``backend`` is ``"triton"`` and the Triton path was not found (``found`` None)."""
    if backend == "triton" and found is None:
        raise RuntimeError("SEBP backend 'triton' was asked for but triton is not importable")


def row_activity(dy: torch.Tensor, config: SEBPConfig) -> torch.Tensor:
    """Boolean mask (M,) of active rows of a 2-D dL/dY for ``exact`` and ``threshold`` modes.

    NaN/Inf rows are active. The reductions run straight on ``dy`` (no |dy| or bool temporaries): on a CPU
    this scan would otherwise cost as much as the GEMMs it saves.
    """
    if config.mode == "exact":
        return dy.any(dim=1)  # NaN and Inf are truthy; -0.0 is not, and contributes nothing anyway
    if config.mode == "threshold":
        eps = min(config.eps, torch.finfo(dy.dtype).max)  # rounded to +inf it would hide Inf rows
        hi, lo = dy.amax(dim=1), dy.amin(dim=1)
        return (hi > eps) | (lo < -eps) | torch.isnan(hi)
    raise ValueError(f"row_activity does not handle mode {config.mode!r}")


def topk_rows(dy: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (sorted) of the ``n`` rows of largest L2 norm; non-finite rows rank first."""
    m = dy.shape[0]
    if n >= m:
        return torch.arange(m, device=dy.device)
    norms = torch.linalg.vector_norm(dy.float(), dim=1)
    norms = torch.where(torch.isfinite(norms), norms, torch.full_like(norms, float("inf")))
    return torch.topk(norms, n, sorted=False).indices.sort().values


def select_rows(dy: torch.Tensor, config: SEBPConfig) -> torch.Tensor:
    """Sorted int64 indices of the active rows of a 2-D dL/dY (``sampled``: the non-zero rows, before the draw)."""
    if config.mode == "topk":
        return topk_rows(dy, config.top_n)
    if config.mode == "sampled":  # its deterministic part: the non-zero rows it draws from
        return dy.any(dim=1).nonzero().squeeze(1)
    return row_activity(dy, config).nonzero().squeeze(1)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The bias gradient's accumulation dtype: fp32, fp64 for fp64 (an fp32 sum cost fp64 gradients 1e-7)."""
    return torch.promote_types(dtype, torch.float32)


def backward_over_rows(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The three backward products of ``Y = X Wᵀ + b`` over the given rows of 2-D ``dy`` (M, out).

    dX (M, in) is zero outside ``rows``; dW = dy[rows]ᵀ x[rows]; db = dy[rows].sum(0). ``scale`` (M,): each row of
    ``dy`` multiplied by it first (the 1/p of sampled mode; a factor 1 changes no bit).
    """
    m, k = dy.shape[0], rows.numel()
    if k == m:  # every row active: the dense products, no gather or scatter
        return dense_products(dy if scale is None else dy * scale[:, None], x, weight, need_dx, need_dw, need_db)
    dy_a = dy.index_select(0, rows)
    if scale is not None:
        dy_a = dy_a * scale.index_select(0, rows)[:, None]
    dx = dw = db = None
    if need_dx:
        dx = dy.new_zeros((m, weight.shape[1]))
        if k:
            dx.index_copy_(0, rows, dy_a @ weight)
    if need_dw:
        dw = dy_a.t() @ x.index_select(0, rows)
    if need_db:
        db = dy_a.sum(0, dtype=_acc(dy.dtype)).to(dy.dtype)
    return dx, dw, db


def dense_products(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The three backward products of ``Y = X Wᵀ + b`` over all rows of 2-D ``dy``; None where not needed."""
    return (dy @ weight if need_dx else None, dy.t() @ x if need_dw else None,
            dy.sum(0, dtype=_acc(dy.dtype)).to(dy.dtype) if need_db else None)


def sebp_backward_torch(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SEBPConfig,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
):
    """Row selection + backward over those rows, all in torch. ``dy`` (M, out), ``x`` (M, in)."""
    rows = select_rows(dy, config)
    return backward_over_rows(dy, x, weight, rows, need_dx, need_dw, need_db)


def norm_backward_torch(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of a LayerNorm (``mean`` given) or RMSNorm (``mean`` None) over the rows of 2-D ``dy`` (M, N)
    that hold a non-zero (exact mode); fp32 math (fp64 for fp64). ``x`` (M, N) is the norm's input, ``rstd`` (M,) its
    1/sqrt(var + eps) and ``weight`` (N,) its scale or None. dX is zero on the other rows (their dY is zero,
    so the dense backward gives zero there too); dW = sum of dY * x_hat and db = sum of dY over the active
    rows, where x_hat = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm)."""
    acc = torch.promote_types(dy.dtype, torch.float32)  # fp32 math, fp64 for fp64 inputs
    rows = dy.any(dim=1).nonzero().squeeze(1)
    d = dy.index_select(0, rows).to(acc)
    xh = x.index_select(0, rows).to(acc)
    if mean is not None:
        xh = xh - mean.index_select(0, rows).to(acc)[:, None]
    r = rstd.index_select(0, rows).to(acc)[:, None]
    xh = xh * r
    dx = dw = db = None
    if need_dx:
        g = d * weight.to(acc) if weight is not None else d
        c1 = (g * xh).mean(dim=1, keepdim=True)
        dxa = g - xh * c1
        if mean is not None:
            dxa = dxa - g.mean(dim=1, keepdim=True)
        dx = dy.new_zeros(x.shape, dtype=x.dtype)
        dx.index_copy_(0, rows, (dxa * r).to(x.dtype))
    if need_dw and weight is not None:
        dw = (d * xh).sum(0).to(weight.dtype)
    if need_db:
        db = d.sum(0).to(weight.dtype if weight is not None else dy.dtype)
    return dx, dw, db


def linear_rows_torch(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """2-D ``x`` (M, in) @ ``weight``ᵀ + ``bias`` on rows ``perm[:count]``, zeros (the bias) on the others: the
    oracle of the Triton forward over rows (reads the count on the host)."""
    rows = perm[: int(count.reshape(-1)[0])].long()
    y = x.new_zeros((x.shape[0], weight.shape[0]))
    if bias is not None:
        y += bias
    y[rows] = F.linear(x[rows], weight, bias)
    return y
