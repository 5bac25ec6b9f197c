"""Linear layer + cross-entropy over the labelled rows only, in chunks of rows.

``F.cross_entropy(F.linear(h, W, b), labels)`` materialises the logits of every row, labelled or not, and the
softmax gradient of all of them: rows x V floats, several GiB for a modern vocabulary. Rows whose label is
``ignore_index`` (prompt tokens in SFT, ~85% of positions in masked-language modelling) get no loss, so their
logits are wasted work. :func:`linear_cross_entropy` gathers the labelled rows and, chunk by chunk, computes
their logits, log-sum-exp, loss, the logits' gradient, and at once that chunk's share of dL/dh, dL/dW and
dL/db. The full logits never exist; each product runs once (3 GEMMs of the labelled rows in all), and the
backward only scales the stored gradients by the incoming scalar.

On CUDA one Triton kernel per chunk (:mod:`._triton.ce`) turns the logits into the loss and, in place, the
logits' gradient: the chunk's logits exist once, in the compute dtype. Elsewhere (and for fp64) the same
arithmetic runs as torch ops on an fp32 copy of the chunk: the reference the kernel is tested against.

Memory: a chunk holds ``chunk_rows x V`` logits (on the torch path in fp32, plus a copy in the compute dtype
under autocast); the default keeps that working set near ``CHUNK_BYTES`` (320 MiB) and splits the rows in
equal chunks: 4096 labelled rows of V = 128256 or 151936 in bf16 on the kernel's path run in 4 chunks of 1024.
Chunk sizes from 832 to 1408 rows are timed on an H100 by ``benchmarks/head_bench.py --extra-chunks``
(results/head.json): at 1408 rows the Qwen2.5-0.5B-shaped step's peak memory was above Cut-Cross-Entropy's, at
832 its head ran 1.2x slower than at 1024.
"""
from __future__ import annotations

import torch

from . import label_checks

CHUNK_BYTES = 320 * 2**20  # the per-chunk working set the default chunk size aims at
_ROW_MULTIPLE = 128  # chunks of whole 128-row tiles (on an H100, 832 rows a chunk ran the head 1.2x slower
#                       than 1024 or 1408: results/head.json)


def default_chunk_rows(vocab: int, compute_dtype: torch.dtype, fused: bool = False) -> int:
    """Rows per chunk so that the chunk's logits take about ``CHUNK_BYTES``: in the compute dtype alone with
    the ``fused`` kernel, else fp32 plus a compute-dtype copy below fp32."""
    per_row = vocab * (compute_dtype.itemsize if fused else
                       4 + (compute_dtype.itemsize if compute_dtype.itemsize < 4 else 0))
    rows = max(1, CHUNK_BYTES // per_row)
    return rows if rows < _ROW_MULTIPLE else rows // _ROW_MULTIPLE * _ROW_MULTIPLE


def balanced_chunk_rows(n: int, most: int) -> int:
    """Rows per chunk for ``n`` rows and at most ``most`` a chunk: as few chunks as ``most`` allows, of equal
    size (whole tiles of 128 rows where ``most`` allows), so that no last chunk runs a thin product."""
    if n <= most:
        return max(n, 1)
    per = -(-n // -(-n // most))
    if most >= _ROW_MULTIPLE:
        per = min(most // _ROW_MULTIPLE * _ROW_MULTIPLE, -(-per // _ROW_MULTIPLE) * _ROW_MULTIPLE)
    return per


def labelled_rows(labels: torch.Tensor, vocab: int, ignore_index: int = -100,
                  count: int | None = None) -> torch.Tensor:
    """Sorted indices of the entries of flat ``labels`` that are not ``ignore_index``; raises ValueError when
    one of them is outside [0, vocab). ``count``: how many there are, when the caller knows it (a Python int):
    the indices then have a shape known before the labels' values, so ``torch.compile`` traces this without a
    graph break (the range check becomes a device-side assert there; eagerly a wrong count raises). Eagerly,
    given ``count``, inside :func:`~sebp_kernels.label_checks.deferred`: no host sync; both checks are read
    where that block's owner waits anyway (a head reads the labels through
    :func:`~sebp_kernels.label_checks.safe` meanwhile)."""
    keep = labels != ignore_index
    bad = keep & ((labels < 0) | (labels >= vocab))
    held = label_checks.active()
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"a label is outside [0, {vocab}) and is not ignore_index {ignore_index}")
    elif held is not None and count is not None:
        held.add(labels, bad, keep, count, vocab, ignore_index)
        return keep.nonzero_static(size=count, fill_value=0).squeeze(1)
    elif bad.any():
        first = labels[bad][0].item()
        raise ValueError(f"label {first} is outside [0, {vocab}) (and is not ignore_index {ignore_index})")
    if count is None:
        return keep.nonzero().squeeze(1)
    if not torch.compiler.is_compiling() and int(keep.sum()) != count:
        raise ValueError(f"{int(keep.sum())} labels are not ignore_index {ignore_index}, not the {count} given")
    return keep.nonzero_static(size=count).squeeze(1)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_rows: int | None = None,
    labelled: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels, ...)`` over the labelled rows only, a chunk of
    rows at a time (the logits of all rows are never held at once).

    With no labelled row the loss is 0 and every gradient is zero (F.cross_entropy's mean gives NaN there).
    Under ``torch.autocast`` the products run in the autocast dtype (fp32 accumulation) and the softmax and
    loss in fp32, like the autocast dense path. A weight that needs no gradient (frozen, LoRA) costs no dW
    product; a weight shared with the input embeddings gets the sum of both gradients through autograd as usual.

    Args:
        hidden: the hidden states, ``(..., d)``, flattened to rows.
        weight: the output layer's weight, ``(V, d)``.
        labels: the target of each row, ``(...)`` (the leading shape of ``hidden``).
        bias: the output layer's bias, ``(V,)``, or None.
        ignore_index: the label of rows without a target (left out).
        label_smoothing: as in ``F.cross_entropy``, in [0, 1].
        reduction: ``"mean"`` (over the labelled rows, like F.cross_entropy) or ``"sum"``.
        chunk_rows: rows per chunk; None: at most :func:`default_chunk_rows`, the rows split in equal chunks
            (:func:`balanced_chunk_rows`). Smaller lowers the peak memory, larger runs fewer, bigger products.
        labelled: how many labels are not ``ignore_index``, when the caller knows it (a Python int): no host
            sync, and no graph break under ``torch.compile`` (see :func:`labelled_rows`); None: counted.

    Returns:
        The loss, a 0-d tensor: fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: an unknown ``reduction``, ``label_smoothing`` outside [0, 1], ``chunk_rows`` < 1, or shapes
            of ``hidden``, ``weight`` and ``labels`` that do not match.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., {hidden.shape[-1]}) does not match weight {tuple(weight.shape)} (V, d)")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match the rows of hidden {tuple(hidden.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    rows = labelled_rows(y, weight.shape[0], ignore_index, labelled)
    if rows.numel() < y.numel():
        h, y = h.index_select(0, rows), y.index_select(0, rows)
    y = label_checks.safe(y, weight.shape[0], ignore_index)  # checks held on the device: no label past the logits
    dev = h.device.type
    if torch.is_autocast_enabled(dev) and h.dtype != torch.float64:  # autocast leaves fp64 alone too
        compute = torch.get_autocast_dtype(dev)
    elif h.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"hidden ({h.dtype}), weight ({weight.dtype}) and bias differ in dtype: run under "
                         "torch.autocast or cast them alike")
    else:
        compute = weight.dtype
    if torch.compiler.is_compiling():  # one opaque op: the chunk loop would specialize the graph on the row count
        need_db = bias is not None and bias.requires_grad
        return _linear_ce_op(h, weight, bias, y, compute, float(label_smoothing), reduction, chunk_rows or 0,
                             h.requires_grad, weight.requires_grad, need_db)[0]
    fused = _fused_ce(h, compute)
    chunk = chunk_rows or balanced_chunk_rows(h.shape[0], default_chunk_rows(weight.shape[0], compute,
                                                                            fused is not None))
    return _LinearCrossEntropy.apply(h, weight, bias, y, compute, float(label_smoothing), reduction, chunk, fused)


# Under torch.compile: the loss and every gradient from one custom op, which Dynamo does not trace into. Traced,
# the Python chunk loop would make the graph depend on the number of labelled rows, and every batch with another
# count (every packed batch) would compile again. Its outputs: the loss and dL/dh, dL/dW, dL/db (empty where not
# needed); its backward scales them by dL/dloss, as the autograd Function's does.
@torch.library.custom_op("sebp::linear_ce", mutates_args=())
def _linear_ce_op(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                  compute: torch.dtype, smoothing: float, reduction: str, chunk_rows: int, need_dh: bool,
                  need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fused = _fused_ce(h, compute)
    chunk = chunk_rows or balanced_chunk_rows(h.shape[0], default_chunk_rows(weight.shape[0], compute,
                                                                            fused is not None))
    with torch.autocast(h.device.type, enabled=False):
        loss, grads = _chunked(h, weight, bias, y, compute, smoothing, reduction, chunk, need_dh, need_dw,
                               need_db, fused)
    empty = h.new_empty(0)
    return loss, *(g if g is not None else empty for g in grads)


@_linear_ce_op.register_fake
def _(h, weight, bias, y, compute, smoothing, reduction, chunk_rows, need_dh, need_dw, need_db):
    empty = h.new_empty(0)
    return (h.new_empty((), dtype=torch.promote_types(compute, torch.float32)),
            h.new_empty(h.shape) if need_dh else empty, weight.new_empty(weight.shape) if need_dw else empty,
            bias.new_empty(bias.shape) if need_db else empty)


def _linear_ce_setup(ctx, inputs, output) -> None:
    ctx.needs = inputs[8:11]
    ctx.save_for_backward(*output[1:])


def _linear_ce_backward(ctx, dloss, *_):
    grads = [g * dloss.to(g.dtype) if need else None for g, need in zip(ctx.saved_tensors, ctx.needs)]
    return (*grads, None, None, None, None, None, None, None, None)


_linear_ce_op.register_autograd(_linear_ce_backward, setup_context=_linear_ce_setup)


def _fused_ce(h: torch.Tensor, compute: torch.dtype):
    """The Triton chunk kernel where it runs for these rows (CUDA, fp32/fp16/bf16), else None."""
    if compute not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    try:
        from ._triton import ce
    except ImportError:
        return None
    return ce.ce_grad_inplace if ce.usable(h.new_empty(0, dtype=compute)) else None


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, every gradient; backward scales them by dL/dloss."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, compute, smoothing, reduction, chunk, fused):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        with torch.autocast(h.device.type, enabled=False):
            loss, grads = _chunked(h, weight, bias, y, compute, smoothing, reduction, chunk,
                                   need_dh, need_dw, need_db and bias is not None, fused)
        ctx.grads = grads
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy's backward ran twice; its gradients are spent after one")
        grads, ctx.grads = ctx.grads, None
        # the stored gradients are private to this call: scaling them in place saves a V x d copy of dW
        scaled = [g.mul_(dloss.to(g.dtype)) if g is not None else None for g in grads]
        return (*scaled, None, None, None, None, None, None)


def _chunked(h, weight, bias, y, compute, smoothing, reduction, chunk, need_dh, need_dw, need_db, fused=None):
    """(loss, [dh, dW, db]) with the gradients of ``reduction``'s loss; None where not needed. ``fused``: the
    chunk kernel of :mod:`._triton.ce` (loss and gradient in place of the logits), else torch ops."""
    n, d = h.shape
    vocab = weight.shape[0]
    acc = torch.promote_types(compute, torch.float32)
    h_c = h.to(compute)
    w_c = weight.to(compute)
    b_c = bias.to(compute) if bias is not None else None
    scale = 1.0 / n if (reduction == "mean" and n) else 1.0
    n_chunks = -(-n // chunk)
    # one chunk: dW straight in the product's dtype, as the dense path; several: an fp32 (or wider) sum, except
    # on the kernel's path with a 16-bit weight, where cuBLAS adds each chunk's product in fp32 into the weight's
    # dtype (one rounding a chunk; a V x d fp32 sum would cost its memory and a pass over it per chunk)
    wide = n_chunks > 1 and (fused is None or weight.dtype.itemsize >= 4)
    dw_dtype = torch.promote_types(weight.dtype, torch.float32) if wide else weight.dtype
    dh = torch.empty(n, d, dtype=compute, device=h.device) if need_dh else None
    dw = db = None
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, n, chunk):
        hc, yc = h_c[start:start + chunk], y[start:start + chunk]
        z = torch.addmm(b_c, hc, w_c.t()) if b_c is not None else hc @ w_c.t()
        if fused is not None:
            total += fused(z, yc, scale, smoothing).sum()
            g = z  # now the logits' gradient, in the compute dtype
            if need_db:
                db = g.sum(0, dtype=torch.float32) if db is None else db.add_(g.sum(0, dtype=torch.float32))
            if need_dh:
                torch.mm(g, w_c, out=dh[start:start + chunk])
            if need_dw:
                dw = _accumulate(dw, g.t(), hc, dw_dtype)
            continue
        z = z.to(acc)  # no copy when compute is already fp32
        lse = torch.logsumexp(z, dim=1)
        nll = lse - z.gather(1, yc[:, None]).squeeze(1)
        if smoothing:
            # F.cross_entropy's smoothing: (1 - e) * nll + e * mean_j(-log p_j)
            nll = (1.0 - smoothing) * nll + smoothing * (lse - z.mean(dim=1))
        total += nll.sum()
        if not (need_dh or need_dw or need_db):
            continue
        p = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
        p.scatter_add_(1, yc[:, None], torch.full_like(yc[:, None], smoothing - 1.0, dtype=acc))
        if smoothing:
            p.sub_(smoothing / vocab)
        p.mul_(scale)
        if need_db:
            db = p.sum(0) if db is None else db.add_(p.sum(0))
        g = p.to(compute)
        if need_dh:
            torch.mm(g, w_c, out=dh[start:start + chunk])
        if need_dw:
            dw = _accumulate(dw, g.t(), hc, dw_dtype)
    loss = total * scale
    if need_dw:
        dw = dw.to(weight.dtype) if dw is not None else torch.zeros_like(weight)
    if need_db:
        db = db.to(bias.dtype) if db is not None else torch.zeros_like(bias)
    if need_dh:
        dh = dh.to(h.dtype)
    return loss, [dh, dw, db]


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc + a @ b`` in ``dtype`` (``a @ b`` alone when ``acc`` is None), updating ``acc`` in place."""
    if acc is None:
        prod = a @ b
        return prod if prod.dtype == dtype else prod.to(dtype)
    if a.dtype == dtype:
        return acc.addmm_(a, b)
    if acc.is_cuda and _wide_addmm_works(acc.device):
        return torch.addmm(acc, a, b, out_dtype=dtype, out=acc)
    return acc.add_(a @ b)


_WIDE_ADDMM: dict[torch.device, bool] = {}


def _wide_addmm_works(device: torch.device) -> bool:
    """Whether this torch build adds a 16-bit product into an fp32 accumulator in one cuBLAS call
    (``addmm(..., out_dtype=float32, out=acc)``): a V x d product per chunk less to write and read back.
    Tried once per device on a small case and checked against the two-step sum."""
    if device not in _WIDE_ADDMM:
        a = torch.randn(64, 48, device=device).to(torch.bfloat16)
        b = torch.randn(48, 32, device=device).to(torch.bfloat16)
        acc = torch.randn(64, 32, device=device)
        want = acc + a.float() @ b.float()
        try:
            got = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _WIDE_ADDMM[device] = bool(torch.allclose(got, want, atol=1e-3, rtol=1e-3)) and got is acc
        except (RuntimeError, TypeError):
            _WIDE_ADDMM[device] = False
    return _WIDE_ADDMM[device]
