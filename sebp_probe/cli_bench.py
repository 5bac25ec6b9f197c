"""The ``bench`` command: the per-layer and whole-model GPU benchmarks, their options and tables."""
from __future__ import annotations

import sys

import typer

from .cli_common import UserError, one_line_errors, parse_budget
from .config import COMPILE_MODES
from .tables import bench_tables, console


@one_line_errors
def bench_cmd(
    model: str = typer.Argument("bert-base", help="Shape set (bert-base, llama-3.2-3b, llama-3.2-1b, "
                                "qwen2.5-1.5b, qwen2.5-0.5b), local model directory or hub id; with --scope "
                                "model a whole-model case (bert-base, llama-3.2-1b-sft, qwen2.5-0.5b-sft, "
                                "llama-3.2-3b, qwen2.5-1.5b)."),
    rows: int = typer.Option(None, "--rows", "-M", help="Rows of dL/dY (batch x seq tokens)."),
    in_features: int = typer.Option(None, "--in-features", help="One explicit layer (with --out-features)."),
    out_features: int = typer.Option(None, "--out-features"),
    seq: int = typer.Option(None, "--seq", help="Tokens per sequence: active rows are laid out as right padding."),
    densities: str = typer.Option("0.01,0.05,0.1,0.2,0.5,1.0", "--densities", "-d",
                                  help="Fractions of active rows, comma-separated."),
    scope: str = typer.Option("layers", "--scope", help="layers | model (whole-model forward+backward) | all."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32."),
    mode: str = typer.Option("exact", "--mode", help="exact | threshold | topk (N = active rows) | sampled (at "
                             "--budget, dX exact and sampled, CUDA graphs and eager)."),
    repeats: int = typer.Option(30, "--repeats", help="Timed repeats per measurement (median)."),
    model_repeats: int = typer.Option(5, "--model-repeats", help="Timed steps per batch in the whole-model run."),
    model_batches: int = typer.Option(8, "--model-batches", help="Whole model: batches in the pool of sequences "
                                      "that every layout lays out."),
    output: str = typer.Option(None, "--output", "-o", help="Write the results (with GPU, versions, date, "
                               "command) to this JSON file."),
    graphs: bool = typer.Option(False, "--graphs", help="Whole model: also time each step as CUDA-graph "
                                "replays (no host launch overhead) where the batch has a fixed shape."),
    figure: str = typer.Option(None, "--figure", help="Whole model: draw step ms per layout, dense vs SEBP (vs "
                               "Liger), to this image (.png, .pdf, .svg)."),
    tiny: bool = typer.Option(False, "--tiny", help="Whole model: the case shrunk to hidden size 32 and 2 layers "
                              "(same layouts and labels); runs on a CPU without a GPU (a check, not a timing)."),
    pad_mask: bool = typer.Option(True, "--pad-mask/--no-pad-mask", help="Whole model, decoders: pass the "
                                  "padding mask (default, as a data collator does) or leave it out (right "
                                  "padding: same loss and gradients, causal attention kernel)."),
    breakdown: bool = typer.Option(False, "--breakdown", help="Whole model: split one backward's GPU kernel "
                                   "time by kind (GEMMs, attention, SEBP, elementwise, ...)."),
    norms: bool = typer.Option(False, "--norms", help="Whole model: the SEBP run also swaps LayerNorm/RMSNorm "
                               "for the SEBP norm (exact: their zero rows of dL/dY skipped too)."),
    acts: bool = typer.Option(False, "--acts", help="Whole model: the SEBP run also runs the MLP activations "
                              "(SwiGLU, GELU) as SEBP activations (their zero rows skipped; the linears "
                              "before them skip their row selection)."),
    keep_dx: bool = typer.Option(False, "--keep-dx", help="Whole model: the SEBP run keeps each dX's zero rows "
                                 "between backwards (sebp_kernels.zero_rows)."),
    pad_rows: bool = typer.Option(True, "--pad-rows/--no-pad-rows", help="Whole model: the SEBP linears take "
                                  "a batch's padding rows from its attention mask (checked once) instead of "
                                  "selecting them (sebp_kernels.pad_rows)."),
    compile_mode: str = typer.Option(None, "--compile", metavar="MODE", help="Whole model: also time every "
                                     "entry compiled (torch.compile with dynamic shapes, once per entry; compile "
                                     "seconds and recompiles per row) in this mode: default | reduce-overhead | "
                                     "max-autotune | max-autotune-no-cudagraphs. SEBP entries patch the linears "
                                     "only unless --norms/--acts (Inductor fuses those)."),
    compile_scope: str = typer.Option("layers", "--compile-scope", help="Whole model, with --compile: what "
                                      "compiles: each transformer layer, the embeddings, head and loss eager "
                                      "(layers: one layer's compile, seconds) or the whole step (step: "
                                      "minutes on a 1B model)."),
    layouts: str = typer.Option(None, "--layouts", help="Whole model: only these layouts, comma-separated "
                                "(max_length, longest, bucket, packed; default all)."),
    methods: str = typer.Option(None, "--methods", help="Whole model: only these methods, comma-separated "
                                "(dense, sebp, liger, cce; default all; sampled, opt-in: sampled mode at --budget), "
                                "or one head of a method as method:head (sebp:labelled)."),
    budget: str = typer.Option("auto", "--budget", help="Whole model: the sampled method's budget: auto (each "
                               "layer's variance rule) or the share of each layer's non-zero rows kept for dW, "
                               "in (0, 1]."),
    sample_dx: bool = typer.Option(False, "--sample-dx", help="Whole model: the sampled method takes dX from the "
                                   "sample too (as finetune --sample-dx)."),
    probe: bool = typer.Option(False, "--probe", help="Whole model: time each dense and SEBP entry also as "
                               "finetune --probe-every's probed step (the gradient statistics' hooks on the "
                               "step's own backward), interleaved with the unprobed step; the ratio per row."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run and exit (no GPU needed)."),
) -> None:
    """Time the SEBP backward on the GPU against dense cuBLAS, the torch reference and the ideal.

    Examples:

    - `sebp-probe bench` : BERT-base layer shapes (16384 rows), densities 0.01 ... 1.0
    - `sebp-probe bench llama-3.2-3b --densities 0.1,0.2,0.5 -o results.json`
    - `sebp-probe bench --rows 8192 --in-features 4096 --out-features 11008`
    - `sebp-probe bench ./my-model --rows 8192 --seq 256` : shapes read from a local config
    - `sebp-probe bench bert-base --scope model --graphs -o bert.json --figure bert.png` : whole model, every
      layout (max_length, longest, bucket, packed), dense vs SEBP, eager and as CUDA graphs
    - `sebp-probe bench llama-3.2-1b-sft --scope model --norms --acts` : SFT batches, the labelled-rows head
      too, Liger-Kernel where it imports; SEBP on the norms and MLP activations as well
    - `sebp-probe bench llama-3.2-3b --scope model --no-pad-mask --breakdown` : causal attention without the
      padding mask, and where the backward's GPU time goes
    - `sebp-probe bench llama-3.2-1b-sft --scope model --tiny` : the whole run on a tiny model (CPU: seconds)
    - `sebp-probe bench llama-3.2-1b-sft --scope model --compile default --layouts packed,longest` : compiled
      entries too (and Cut-Cross-Entropy, Liger compiled), on two layouts
    - `sebp-probe bench bert-base --scope model --probe --compile default --layouts longest --methods dense:full`
      : what a finetune --probe-every step costs over an unprobed one, eager and compiled
    - `sebp-probe bench llama-3.2-3b --scope all --dry-run` : show the plan only

    Per layer: dense = cuBLAS backward; ideal = cuBLAS on the k active rows already contiguous; ideal +io =
    the ideal plus the bytes SEBP cannot skip (dY's inactive rows read, dX's zero rows written) at the fill
    bandwidth measured in the run; triton = the fused SEBP backward (selection included); torch ref = the
    pure-torch SEBP. Whole model: step = forward + backward of one batch (median ms, mean over the batches every
    layout forms from one pool of sequences); the limit of a layout = its step with the backward GEMMs of the
    inactive rows removed (see sebp_probe/bench/bench_cases.py). Exit code 1 without a GPU (unless --tiny).
    """
    import json
    import shlex

    import torch

    from .bench import bench, bench_cases, bench_compile, bench_model, bench_sampled, probe_overhead
    from .analysis.plots import check_image_path, plot_bench_models

    if scope not in ("layers", "model", "all"):
        raise UserError(f"--scope must be layers, model or all, got {scope!r}")
    if dtype not in bench.DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(bench.DTYPES)}, got {dtype!r}")
    if mode not in ("exact", "threshold", "topk", "sampled"):
        raise UserError(f"--mode must be exact, threshold, topk or sampled, got {mode!r}")
    if mode == "sampled" and (scope != "layers" or budget == "auto"):
        raise UserError("--mode sampled times one layer at a fixed share: use --scope layers and --budget B "
                        "(for the whole model: --methods sampled)")
    if repeats < 1 or model_repeats < 1 or model_batches < 1:
        raise UserError("--repeats, --model-repeats and --model-batches must be >= 1")
    if mode == "topk" and scope != "layers":
        raise UserError("--mode topk needs an N per layer, which only the per-layer benchmark sets "
                        "(N = active rows); use --scope layers, or exact/threshold for the whole model")
    dens = bench.parse_densities(densities)
    shapes = bench.resolve_shapes(model, rows, in_features, out_features, seq) if scope != "model" else []
    cases = []
    if scope != "layers":
        if model.lower() not in bench_cases.MODEL_CASES:
            raise UserError(f"no whole-model case for {model!r}; choose one of {', '.join(bench_cases.MODEL_CASES)}")
        case = bench_cases.MODEL_CASES[model.lower()]
        cases = [bench_cases.tiny(case) if tiny else case]
        try:
            bench_model.check_pad_mask(case, pad_mask)
        except ValueError as e:
            raise UserError(f"--no-pad-mask: {e}") from None
        if figure:
            check_image_path(figure)
    elif (not pad_mask or breakdown or norms or acts or keep_dx or tiny or figure or not pad_rows or compile_mode
          or layouts or methods or probe or sample_dx):
        raise UserError("--no-pad-mask, --breakdown, --norms, --acts, --keep-dx, --no-pad-rows, --tiny, --figure, "
                        "--compile, --layouts, --methods, --probe and --sample-dx are for the whole-model run "
                        "(--scope model or all; the per-layer sampled bench times dX both ways)")
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise UserError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    if compile_scope not in bench_compile.SCOPES:
        raise UserError(f"--compile-scope must be one of {', '.join(bench_compile.SCOPES)}, got {compile_scope!r}")
    budget = parse_budget(budget)
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    chosen = dict(layouts=split(layouts) if layouts is not None else bench_cases.LAYOUTS,
                  methods=split(methods) if methods is not None else bench_model.METHODS)
    try:
        bench_model.check_selection(**chosen)
    except ValueError as e:
        raise UserError(f"--layouts/--methods: {e}") from None
    if dry_run:
        plans = [bench_model.plan(c, model_batches, graphs, pad_mask, bench.DTYPES[dtype], compile=compile_mode,
                                  compile_scope=compile_scope, **chosen) for c in cases]
        console.print_json(json.dumps(bench.run_plan(shapes, dens, plans)))
        return
    device = "cpu" if tiny and not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        bench._require_cuda()
    from pathlib import Path

    from .train.rundir import write_json

    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    result = {"command": "sebp-probe " + shlex.join(sys.argv[1:]), "environment": bench.environment(),
              "dtype": dtype, "mode": mode, "densities": dens, "layers": [], "models": [],
              **({"budget": budget} if mode == "sampled" else {})}
    with console.status("benchmarking") as status:
        def progress(msg: str) -> None:
            status.update(msg)

        def note(msg: str) -> None:
            console.print(msg, highlight=False, soft_wrap=True)

        for s in shapes:
            rs = (bench_sampled.bench_layer_sampled(s, dens, bench.DTYPES[dtype], budget, repeats, progress=progress)
                  if mode == "sampled" else bench.bench_layer(s, dens, bench.DTYPES[dtype], mode, repeats,
                                                              progress=progress))
            for r in rs:
                result["layers"].append(r.to_dict())
        def partial(model_so_far: dict) -> None:  # a run cut short keeps what it measured
            if output:
                write_json(Path(output), {**result, "models": [*result["models"], model_so_far], "complete": False})

        for case in cases:
            result["models"].append(bench_model.bench_model(
                case, bench.DTYPES[dtype], model_repeats, model_batches, mode=mode, graphs=graphs, progress=progress,
                pad_mask=pad_mask, breakdown=breakdown, norms=norms, acts=acts, keep_dx=keep_dx, device=device,
                pad_rows=pad_rows, compile=compile_mode, compile_scope=compile_scope, note=note, partial=partial,
                probe=probe, budget=budget, sample_dx=sample_dx, **chosen))
    if output:  # first: what was measured survives any trouble with the tables
        write_json(Path(output), result)
    if figure and result["models"]:
        console.print(f"figure written to {plot_bench_models(result['models'], figure)}", highlight=False,
                      soft_wrap=True)
    bench_tables(result)
    for m in result["models"]:
        for line in probe_overhead.probe_lines(m):
            console.print(line, highlight=False, soft_wrap=True)
    if output:
        console.print(f"results written to {output}", highlight=False, soft_wrap=True)
