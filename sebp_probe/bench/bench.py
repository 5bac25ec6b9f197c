"""GPU benchmark of the SEBP backward per linear layer (whole models: :mod:`.bench_model`). No CLI code here.

Per layer, for each density (fraction of active rows of dL/dY, laid out like right padding: the first
rows of each sequence are real), the backward of one linear is timed as:

- ``dense``: cuBLAS, what autograd runs for ``F.linear`` (dX = dY W, dW = dYᵀ X, db = dY.sum(0));
- ``torch_ref``: the pure-torch SEBP (``nonzero()`` selection, gather, GEMMs, scatter; it syncs the host);
- ``torch_rows``: the same GEMMs with the active rows known in advance (no selection);
- ``triton``: the fused Triton SEBP backward (selection included, no host sync);
- ``triton_rows`` (exact mode): the same kernels with the active rows known in advance (no selection pass),
  as the linears before an SEBP activation get them in a model (:mod:`sebp_kernels.activations`);
- ``triton_adaptive``: the same with the layer's density estimate (what ``SEBPLinear`` runs): in exact mode,
  after a backward with at least 85% of rows active it takes the dense cuBLAS backward (timed at steady
  state, after the warm-up calls; every 16th eager backward also runs the row selection, not timed here);
- ``triton_reuse`` and ``triton_rows_reuse`` (``triton_rows_reuse`` in exact mode only): the same two with dX
  in a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` (dX's zero rows kept between backwards, only the rows
  active the time before zeroed), taking turns with a second dY of the same density whose active rows are
  the last ones of each sequence instead of the first (left padding, no row in common below density 0.5):
  each backward zeroes the other's k rows, the most it can have to. Median over both layouts' calls;
- ``ideal``: dense GEMMs on the k active rows already laid out contiguously (selection, gather and the zero
  rows of dX for free): the floor SEBP can approach.
- ``ideal_io`` (computed, not timed): ``ideal`` plus the bytes that SEBP's interface makes unavoidable at the
  GPU's fill bandwidth, measured in the same run (a 256 MiB ``zero_``): the dY rows that have to be read in
  full to find the active ones (the inactive rows; every row in topk mode) and the zero rows of dX (autograd
  takes all of dX). It is the floor when that traffic cannot run beside the GEMMs; on an H100 it did not,
  whatever wrote the zeros (docs/kernels.md).

Times are medians over repeats with CUDA events, with the L2 cache flushed before each repeat; within a
repeat the methods take turns, so clock drift over the run falls on all of them alike. Methods that
make no host sync (dense, triton, ideal) are timed as CUDA-graph replays, so host launch overhead is not
counted for any of them; the torch reference, which cannot be captured, runs eagerly.

"""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

DENSITIES: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class LayerShape:
    """One linear layer's backward problem: ``rows`` = tokens (batch x seq), ``seq`` = tokens per sequence."""

    name: str
    rows: int
    in_features: int
    out_features: int
    bias: bool = True
    seq: int = 512

    def __post_init__(self) -> None:
        for f in ("rows", "in_features", "out_features", "seq"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")


def _llama_like(prefix, rows, seq, hidden, inter, heads, kv_heads, head_dim=None, bias=False):
    head_dim = head_dim or hidden // heads
    kv = kv_heads * head_dim
    shapes = [(f"q/o {hidden}->{heads * head_dim}", hidden, heads * head_dim),
              (f"k/v {hidden}->{kv}", hidden, kv),
              (f"gate/up {hidden}->{inter}", hidden, inter),
              (f"down {inter}->{hidden}", inter, hidden)]
    return [LayerShape(f"{prefix} {n}", rows, i, o, bias, seq) for n, i, o in shapes]


# Built-in shape sets: the distinct projection shapes of each architecture at a typical fine-tuning batch.
SHAPE_SETS: dict[str, Callable[[], list[LayerShape]]] = {
    "bert-base": lambda: [LayerShape("bert-base attn 768->768", 16384, 768, 768),
                          LayerShape("bert-base ffn up 768->3072", 16384, 768, 3072),
                          LayerShape("bert-base ffn down 3072->768", 16384, 3072, 768)],
    "llama-3.2-3b": lambda: _llama_like("llama-3.2-3b", 4096, 4096, 3072, 8192, 24, 8),
    "llama-3.2-1b": lambda: _llama_like("llama-3.2-1b", 4096, 4096, 2048, 8192, 32, 8),
    "qwen2.5-1.5b": lambda: _llama_like("qwen2.5-1.5b", 4096, 4096, 1536, 8960, 12, 2),
    "qwen2.5-0.5b": lambda: _llama_like("qwen2.5-0.5b", 4096, 4096, 896, 4864, 14, 2),
}


def shapes_from_config(cfg, rows: int, seq: int) -> list[LayerShape]:
    """Distinct projection shapes of a Hugging Face config (BERT-like or Llama-like)."""
    hidden = getattr(cfg, "hidden_size", None)
    inter = getattr(cfg, "intermediate_size", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not (hidden and inter and heads):
        raise ValueError(f"cannot read layer shapes from a {type(cfg).__name__} "
                         "(needs hidden_size, intermediate_size, num_attention_heads)")
    name = getattr(cfg, "model_type", "model")
    kv_heads = getattr(cfg, "num_key_value_heads", None)
    if kv_heads is None:  # encoder: q/k/v/o all hidden x hidden, with bias
        return [LayerShape(f"{name} attn {hidden}->{hidden}", rows, hidden, hidden, True, seq),
                LayerShape(f"{name} ffn up {hidden}->{inter}", rows, hidden, inter, True, seq),
                LayerShape(f"{name} ffn down {inter}->{hidden}", rows, inter, hidden, True, seq)]
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    bias = bool(getattr(cfg, "attention_bias", False))
    return _llama_like(name, rows, seq, hidden, inter, heads, kv_heads, head_dim, bias)


def resolve_shapes(model: str | None, rows: int | None = None, in_features: int | None = None,
                   out_features: int | None = None, seq: int | None = None) -> list[LayerShape]:
    """Layer shapes from explicit sizes, a built-in shape set, or a model config (hub id or local dir)."""
    explicit = [v is not None for v in (in_features, out_features)]
    if any(explicit):
        if not all(explicit) or rows is None:
            raise ValueError("explicit shapes need all of --rows, --in-features and --out-features")
        return [LayerShape(f"{rows}x{in_features}->{out_features}", rows, in_features, out_features, True,
                           seq or min(rows, 512))]
    model = model or "bert-base"
    key = model.lower()
    if key in SHAPE_SETS:
        shapes = SHAPE_SETS[key]()
        if rows is not None or seq is not None:
            shapes = [LayerShape(s.name, rows or s.rows, s.in_features, s.out_features, s.bias, seq or s.seq)
                      for s in shapes]
        return shapes
    from transformers import AutoConfig  # lazy: only for configs given by id or path

    try:
        cfg = AutoConfig.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - any loader failure is a user-facing "cannot find"
        raise ValueError(f"unknown shape set or model {model!r} (built-in sets: {', '.join(SHAPE_SETS)}); "
                         f"loading its config failed: {' '.join(str(e).split())[:200]}") from None
    seq = seq or 512
    return shapes_from_config(cfg, rows or 32 * seq, seq)


def parse_densities(text: str | Sequence[float]) -> list[float]:
    """Densities from '0.1,0.5' or a sequence; each in (0, 1]."""
    if isinstance(text, str):
        try:
            vals = [float(t) for t in text.replace(" ", ",").split(",") if t]
        except ValueError:
            raise ValueError(f"densities must be numbers separated by commas, got {text!r}") from None
    else:
        vals = [float(v) for v in text]
    if not vals:
        raise ValueError("give at least one density")
    for v in vals:
        if not (0 < v <= 1) or math.isnan(v):
            raise ValueError(f"density must be in (0, 1], got {v}")
    return vals


# ----------------------------------------------------------------------------------------------- timing


def host_cpu() -> dict:
    """The host's processor model (Linux: /proc/cpuinfo's first ``model name``) and logical core count: steps
    bound by the host (compiled layers without CUDA graphs) differ between machines with the same GPU."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine(), "cores": os.cpu_count()}


def gpu_limits(index: int) -> dict | None:
    """The GPU's power limit (W) and top SM clock (MHz) as ``nvidia-smi`` reports them (two boards of one name, an
    SXM and an NVL part, differ there), or None where it does not answer."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=power.limit,clocks.max.sm",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        power, clock = (v.strip() for v in out.stdout.strip().splitlines()[0].split(","))
        return {"power_limit_w": float(power), "max_sm_clock_mhz": float(clock)}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def environment() -> dict:
    """GPU (and its limits), host processor, versions and date, for the results file."""
    import triton

    dev = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return {
        "gpu": dev.name if dev else None,
        "gpu_memory_gib": round(dev.total_memory / 2**30, 1) if dev else None,
        "sm_count": dev.multi_processor_count if dev else None,
        "gpu_limits": gpu_limits(torch.cuda.current_device()) if dev else None,
        "cpu": host_cpu(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class _Flush:
    """Writes a buffer larger than L2 between repeats, so every repeat starts from a cold cache."""

    def __init__(self):
        self.buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.zero_()


def _prepared(fn: Callable[[], object], graph: bool) -> Callable[[], object]:
    """``fn`` after three warm-up calls, or the replay of a CUDA graph of it when ``graph``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if not graph:
        return fn
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _time_once(run: Callable[[], object], flush: _Flush) -> float:
    flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_fn(fn: Callable[[], object], repeats: int, flush: _Flush, graph: bool) -> float:
    """Median milliseconds of ``fn`` with CUDA events (a CUDA-graph replay when ``graph``)."""
    run = _prepared(fn, graph)
    return statistics.median(_time_once(run, flush) for _ in range(repeats))


def time_methods(methods: dict, repeats: int, flush: _Flush, pooled: dict | None = None) -> dict:
    """Median milliseconds of each ``name: (fn, graph)``, the methods taking turns within every repeat (in
    dict order): the GPU's clocks drift over a run (its power limit), and timing one method's repeats back to
    back let the drift land on whichever came later (H100, 2026-11-22: the same cuBLAS calls measured 1-9%
    apart). ``pooled``: ``{name: into}``, the times of ``name`` join those of ``into`` (one median of both)."""
    runs = {name: _prepared(fn, graph) for name, (fn, graph) in methods.items()}
    times: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(_time_once(run, flush))
    for name, into in (pooled or {}).items():
        times[into] += times.pop(name)
    return {name: statistics.median(t) for name, t in times.items()}


_WARM: list = []  # non-empty once a timing has been thrown away in this process


def fill_bandwidth(flush: _Flush, repeats: int) -> float:
    """TB/s of ``zero_`` on the flush buffer (256 MiB), median over ``repeats`` graph replays: the rate at which
    the GPU writes memory, for the unavoidable bytes of ``ideal_io``."""
    ms = time_fn(flush.buf.zero_, repeats, flush, True)
    return flush.buf.numel() * flush.buf.element_size() / (ms * 1e9)


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory (MiB) that one call of ``fn`` allocates on top of what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def padded_rows(rows: int, seq: int, density: float, device) -> torch.Tensor:
    """Boolean mask of active rows laid out as right padding: the first round(density*seq) of each sequence."""
    n_seq = max(1, rows // seq)
    pos = torch.arange(rows, device=device) % seq if rows >= seq else torch.arange(rows, device=device)
    length = max(1, round(density * (seq if rows >= seq else rows)))
    mask = pos < length
    if n_seq * seq < rows:  # a ragged tail sequence keeps the same density
        mask[n_seq * seq:] = pos[n_seq * seq:] < max(1, round(density * (rows - n_seq * seq)))
    return mask


@dataclass
class LayerResult:
    shape: LayerShape
    density: float
    k: int
    ms: dict = field(default_factory=dict)
    peak_mib: dict = field(default_factory=dict)
    io_bytes: int | None = None  # read and written by SEBP beyond the ideal's traffic (see ideal_io)
    fill_tb_s: float | None = None  # the fill bandwidth that prices them

    def speedup(self, method: str) -> float:
        return self.ms["dense"] / self.ms[method]

    def to_dict(self) -> dict:
        d = {"shape": asdict(self.shape), "density": self.density, "k": self.k, "ms": self.ms,
             "peak_extra_mib": self.peak_mib}
        if self.io_bytes is not None:
            d["io_bytes"], d["fill_tb_s"] = self.io_bytes, self.fill_tb_s
        d["speedup_vs_dense"] = {m: round(self.speedup(m), 3) for m in self.ms}
        if "triton" in self.ms and "ideal" in self.ms:
            d["triton_fraction_of_ideal_speedup"] = round(self.ms["ideal"] / self.ms["triton"], 3)
        if "triton" in self.ms and "ideal_io" in self.ms:
            d["triton_fraction_of_ideal_io_speedup"] = round(self.ms["ideal_io"] / self.ms["triton"], 3)
        for name in ("triton_rows", "triton_reuse", "triton_rows_reuse"):
            if name in self.ms and "ideal" in self.ms:
                d[f"{name}_fraction_of_ideal_speedup"] = round(self.ms["ideal"] / self.ms[name], 3)
        if "triton" in self.ms and "torch_ref" in self.ms:
            d["triton_vs_torch_ref"] = round(self.ms["torch_ref"] / self.ms["triton"], 3)
        return d


def dense_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool):
    """One linear's dense backward over all rows: (dX, dW, db or None), what every layer bench times against."""
    return dy @ w, dy.t() @ x, (dy.sum(0) if bias else None)


def layer_setup(shape: LayerShape, dtype: torch.dtype, seed: int):
    """(device, generator, X, W, flush) of one layer's benchmark: X and W drawn from ``seed`` (the generator
    then draws dY), and the process's first timing thrown away."""
    _require_cuda()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    m, n_in, n_out = shape.rows, shape.in_features, shape.out_features
    x = torch.randn(m, n_in, device=dev, dtype=dtype, generator=g)
    w = (torch.randn(n_out, n_in, device=dev, generator=g) / n_in**0.5).to(dtype)
    flush = _Flush()
    if not _WARM:  # the first timing of a process (graph capture included) is thrown away: it came out 1.5x
        # slow (158 vs 106 us, H100, 2026-11-22). A 0.3 s busy loop before every layer, tried too, made the
        # first dense timing of several layers 5-25% slower instead, so there is none.
        dy = torch.randn(m, n_out, device=dev, dtype=dtype)
        time_fn(lambda: dense_backward(dy, x, w, shape.bias), 5, flush, True)
        _WARM.append(True)
    return dev, g, x, w, flush


def bench_layer(shape: LayerShape, densities: Sequence[float], dtype: torch.dtype = torch.bfloat16,
                mode: str = "exact", repeats: int = 30, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> list[LayerResult]:
    """Time the backward of one linear layer at each density (see the module docstring)."""
    from sebp_kernels import SEBPConfig
    from sebp_kernels._triton import sebp_backward_triton
    from sebp_kernels.density import RowDensity
    from sebp_kernels._triton.select import select_rows_device
    from sebp_kernels.reference import backward_over_rows, sebp_backward_torch
    from sebp_kernels.zero_rows import ZeroRowBuffer

    dev, g, x, w, flush = layer_setup(shape, dtype, seed)
    m, n_in, n_out = shape.rows, shape.in_features, shape.out_features
    dy_full = torch.randn(m, n_out, device=dev, dtype=dtype, generator=g)
    fill_tb_s = fill_bandwidth(flush, repeats)
    results = []
    for density in densities:
        mask = padded_rows(m, shape.seq, density, dev)
        rows = mask.nonzero().squeeze(1)
        k = rows.numel()
        dy = dy_full * mask.unsqueeze(1).to(dtype)
        cfg = (SEBPConfig("topk", top_n=k) if mode == "topk" else
               SEBPConfig("threshold", eps=1e-6) if mode == "threshold" else SEBPConfig("exact"))
        dy_k, x_k = dy.index_select(0, rows).contiguous(), x.index_select(0, rows).contiguous()
        state = RowDensity()  # this layer's density estimate, as an SEBPLinear keeps it across steps
        bias = shape.bias

        def dense():
            return dense_backward(dy, x, w, bias)

        def ideal():
            return dy_k @ w, dy_k.t() @ x_k, (dy_k.sum(0) if bias else None)

        methods = {
            "dense": (dense, True),
            "ideal": (ideal, True),
            "triton": (lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias), True),
            "triton_adaptive": (lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, state=state), True),
            "torch_ref": (lambda: sebp_backward_torch(dy, x, w, cfg, True, True, bias), False),
            "torch_rows": (lambda: backward_over_rows(dy, x, w, rows, True, True, bias), True),
        }
        if mode == "exact":
            known = select_rows_device(dy, "exact")
            methods["triton_rows"] = (lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known),
                                      True)
        # dX kept between backwards, taking turns with the left-padded layout (see the module docstring)
        dy_b = dy_full * mask.flip(0).unsqueeze(1).to(dtype)
        buf = ZeroRowBuffer(m, n_in, dtype, dev)
        methods["triton_reuse"] = (lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, dx_buffer=buf),
                                   True)
        methods["triton_reuse_b"] = (
            lambda: sebp_backward_triton(dy_b, x, w, cfg, True, True, bias, dx_buffer=buf), True)
        pooled = {"triton_reuse_b": "triton_reuse"}
        if mode == "exact":
            known_b = select_rows_device(dy_b, "exact")
            methods["triton_rows_reuse"] = (
                lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known, dx_buffer=buf), True)
            methods["triton_rows_reuse_b"] = (
                lambda: sebp_backward_triton(dy_b, x, w, cfg, True, True, bias, rows=known_b, dx_buffer=buf), True)
            pooled["triton_rows_reuse_b"] = "triton_rows_reuse"
        res = LayerResult(shape, density, k)
        if progress:
            progress(f"{shape.name} d={density:g}")
        res.ms = {name: round(ms, 5) for name, ms in time_methods(methods, repeats, flush, pooled).items()}
        n_read = m if mode == "topk" else m - k  # dY rows read in full to find the active ones
        res.io_bytes = (n_read * n_out + (m - k) * n_in) * dy.element_size()
        res.fill_tb_s = round(fill_tb_s, 3)
        res.ms["ideal_io"] = round(res.ms["ideal"] + res.io_bytes / (fill_tb_s * 1e9), 5)
        for name, (fn, _) in methods.items():
            if name not in pooled:
                res.peak_mib[name] = round(peak_extra_mib(fn), 2)
        results.append(res)
    return results


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the benchmark needs a CUDA GPU (none is visible); use --dry-run to see the plan")


def run_plan(shapes: Sequence[LayerShape], densities: Sequence[float], models: Sequence[dict]) -> dict:
    """What a run would do, without a GPU (for --dry-run); ``models``: the whole-model plans
    (:func:`sebp_probe.bench.bench_model.plan`)."""
    return {"layers": [asdict(s) for s in shapes], "densities": list(densities), "models": list(models)}
