"""finetune() on tiny models and synthetic tokens: exact SEBP reproduces dense, lossy modes still learn,
per-layer dense fallback, LoRA, interrupt + resume, non-finite loss."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from sebp_kernels import SEBPConfig, SEBPLinear
from sebp_probe.train import finetune as ft
from sebp_probe.train import calibration, loop, rundir
from sebp_probe.data import train_data
from sebp_probe.data.assets import LoadedModel
from sebp_probe.config import DataConfig, FinetuneConfig
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import ENCODERS, tiny_config, tiny_model


def _loader(arch, dropout: float = 0.0):
    task = "classification" if arch in ENCODERS else "causal-lm"

    def load():
        if not dropout:
            return LoadedModel(tiny_model(arch), None, task, f"tiny-{arch}", "config")
        cfg = tiny_config(arch)
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
        return LoadedModel(AutoModelForSequenceClassification.from_config(cfg), None, task, "tiny", "config")
    return load


def _cfg(tmp_path, **kw):
    base = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8), output_dir=str(tmp_path / "run"),
                max_steps=20, lr=2e-3, warmup_ratio=0.0, dense_fallback=1.0, fallback_if_slower=False, seed=0)
    base.update(kw)
    return FinetuneConfig(**base)


def _train_losses(path):
    return [json.loads(x)["loss"] for x in open(path) if '"train"' in x]


@pytest.mark.slow
@pytest.mark.parametrize("arch,accum", [("bert", 1), ("bert", 2), ("llama", 1)])
def test_exact_sebp_reproduces_dense_losses(tmp_path, arch, accum):
    data = synthetic_data("classification" if arch in ENCODERS else "causal-lm")
    cfg = _cfg(tmp_path, compare=True, grad_accum=accum)
    s = ft.finetune(cfg, load_fn=_loader(arch), data=data)
    dense, sebp = s["runs"]["dense"], s["runs"]["sebp"]
    assert dense["status"] == sebp["status"] == "completed"
    assert len(sebp["calibration"]["layers"]) == (12 if arch in ENCODERS else 14)
    assert min(sebp["calibration"]["density"].values()) < 0.9  # padding rows really were skipped
    d_loss = _train_losses(tmp_path / "run" / "dense" / "metrics.jsonl")
    s_loss = _train_losses(tmp_path / "run" / "sebp" / "metrics.jsonl")
    assert len(d_loss) == len(s_loss) == 20
    assert max(abs(a - b) for a, b in zip(d_loss, s_loss)) < 1e-5
    assert s["comparison"]["max_abs_loss_gap"] < 1e-5
    assert sum(d_loss[-5:]) < sum(d_loss[:5])  # it learns
    for k, v in dense["final_eval"].items():
        assert sebp["final_eval"][k] == pytest.approx(v, rel=1e-5, abs=1e-6)
    metric = "eval_accuracy" if arch in ENCODERS else "eval_perplexity"
    assert metric in dense["final_eval"]
    cmp = s["comparison"]
    assert {"verdict", "timing", "peak_mem_ratio"} <= set(cmp)
    assert cmp["verdict"] in ("faster", "slower", "within noise")  # 19 steps timed in both runs
    assert ("speedup_step" in cmp) == (cmp["verdict"] != "within noise")
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "eval.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("mode_kw", [dict(mode="topk", top_n=64), dict(eps=1e-4)])
def test_lossy_modes_skip_rows_and_still_learn(tmp_path, mode_kw):
    data = synthetic_data("classification", n=128)
    cfg = _cfg(tmp_path, compare=True, max_steps=40, **mode_kw)
    s = ft.finetune(cfg, load_fn=_loader("bert"), data=data)
    cal = s["runs"]["sebp"]["calibration"]
    it = iter(train_data.make_loaders(cfg, data)[0])
    batches = [next(it) for _ in range(cfg.calib_batches)]  # the calibration's batches
    model = tiny_model("bert")
    exact = calibration.calibrate(model, batches, calibration.candidate_layers(model, _cfg(tmp_path), None), 1.0,
                         torch.device("cpu"), if_slower=False).density
    assert any(cal["density"][n] < exact[n] - 0.05 for n in exact)  # rows beyond the all-zero ones dropped
    d_loss = _train_losses(tmp_path / "run" / "dense" / "metrics.jsonl")
    s_loss = _train_losses(tmp_path / "run" / "sebp" / "metrics.jsonl")
    assert s["comparison"]["max_abs_loss_gap"] > 0
    assert sum(s_loss[-8:]) < sum(s_loss[:8]) - 0.1
    assert abs(sum(s_loss[-8:]) - sum(d_loss[-8:])) / 8 < 0.15


@pytest.mark.slow
def test_dense_fallback_keeps_dense_rows_dense(tmp_path):
    # Every sequence is full length: all rows are active except where only the CLS row gets gradient
    # (the last layer's query, attention output and MLP): only those are worth SEBP. (With the labelled head
    # the last layer computes the CLS rows alone, and nothing is left for SEBP: the full head here.)
    data = synthetic_data("classification", min_len=24, max_len=24)
    cfg = _cfg(tmp_path, dense_fallback=0.9, max_steps=3, head="full")
    s = ft.finetune(cfg, load_fn=_loader("bert"), data=data)
    cal = s["calibration"]
    last = "bert.encoder.layer.1."
    assert set(cal["layers"]) == {last + p for p in ("attention.self.query", "attention.output.dense",
                                                     "intermediate.dense", "output.dense")}
    assert len(cal["fallback_dense"]) == 8 and all(cal["density"][n] == 1.0 for n in cal["fallback_dense"])
    assert all(cal["density"][n] == pytest.approx(1 / 24) for n in cal["layers"])


def test_sebp_slower_than_dense_falls_back_to_dense(monkeypatch):
    model = tiny_model("bert")
    real = calibration.timed_step

    def fake(m, batch, device, autocast, head):  # SEBP's step measured slower than dense's, its backward faster
        real(m, batch, device, autocast, head)
        return (3.0, 0.5) if any(isinstance(x, SEBPLinear) for x in m.modules()) else (1.0, 1.0)

    monkeypatch.setattr(calibration, "timed_step", fake)
    batch = next(iter(train_data.make_loaders(FinetuneConfig(data=DataConfig(max_length=24, batch_size=8)),
                                  synthetic_data("classification"))[0]))
    cands = calibration.candidate_layers(model, FinetuneConfig(), None)
    c = calibration.calibrate(model, [batch], cands, 1.0, torch.device("cpu"), if_slower=True)
    assert c.layers == {} and c.reason and not any(isinstance(x, SEBPLinear) for x in model.modules())
    assert (c.dense_step_ms, c.sebp_step_ms, c.dense_backward_ms, c.sebp_backward_ms) == (2.0, 3.5, 1.0, 0.5)
    assert all(p.grad is None for p in model.parameters())
    c = calibration.calibrate(model, [batch], cands, 1.0, torch.device("cpu"), if_slower=False)
    assert len(c.layers) == 12 and sum(isinstance(x, SEBPLinear) for x in model.modules()) == 12


@pytest.mark.slow
def test_lora_sebp_matches_dense_and_saves_a_plain_model(tmp_path):
    pytest.importorskip("peft")
    cfg = _cfg(tmp_path, compare=True, lora=True, max_steps=8)
    s = ft.finetune(cfg, load_fn=_loader("bert"), data=synthetic_data("classification"))
    assert s["comparison"]["max_abs_loss_gap"] < 1e-5
    assert len(s["runs"]["sebp"]["calibration"]["layers"]) == 12
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "sebp" / "model")
    assert set(saved.state_dict()) == set(tiny_model("bert").state_dict())
    assert not any(isinstance(m, SEBPLinear) for m in saved.modules())
    base = tiny_model("bert").state_dict()
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(saved.state_dict()[key], base[key])  # the LoRA update was merged in


def test_frozen_base_layers_compute_no_weight_gradient():
    """What --lora relies on: SEBP on a frozen weight neither saves X nor computes dW."""
    x = torch.randn(4, 6, 8, requires_grad=True)
    lin = SEBPLinear.from_linear(torch.nn.Linear(8, 5), SEBPConfig("exact"))
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    y = lin(x)
    assert y.grad_fn.saved_tensors[0] is None
    y.sum().backward()
    assert lin.weight.grad is None and x.grad is not None


@pytest.mark.slow
def test_interrupt_then_resume_equals_uninterrupted_run(tmp_path):
    data = synthetic_data("classification", n=40)  # 5 batches per epoch: the run crosses epochs
    kw = dict(max_steps=12, grad_accum=2, eval_steps=4)
    load = _loader("bert", dropout=0.1)  # dropout: the resumed run must restore the RNG too
    full = ft.finetune(_cfg(tmp_path / "a", **kw), load_fn=load, data=data)

    def kill_at_5(kind, p):
        if kind == "step" and p["step"] == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = _cfg(tmp_path / "b", **kw)
    part = ft.finetune(cfg, load_fn=load, data=data, on_event=kill_at_5)
    assert part["status"] == "interrupted" and part["checkpoint"].endswith("step-000005")
    assert json.loads((tmp_path / "b" / "run" / "summary.json").read_text())["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    resumed = ft.finetune(cfg, resume=True, load_fn=load, data=data)
    assert resumed["status"] == "completed"
    a = [json.loads(x) for x in open(tmp_path / "a" / "run" / "metrics.jsonl")]
    b = [json.loads(x) for x in open(tmp_path / "b" / "run" / "metrics.jsonl")]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_ms") and k not in ("peak_mem_mb",  # noqa: E731
                                                                                          "untimed")}
                        for r in rs]
    assert strip(a) == strip(b)  # same losses, evals, lr and epochs, bit for bit
    assert resumed["final_eval"] == full["final_eval"]
    wa = AutoModelForSequenceClassification.from_pretrained(tmp_path / "a" / "run" / "model").state_dict()
    wb = AutoModelForSequenceClassification.from_pretrained(tmp_path / "b" / "run" / "model").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, lr=1e30, max_grad_norm=None, save_steps=1, max_steps=10)
    with pytest.raises(ft.FinetuneError, match="non-finite") as e:
        ft.finetune(cfg, load_fn=_loader("bert"), data=synthetic_data("classification"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["checkpoint"] in str(e.value)
    good = rundir.list_checkpoints(tmp_path / "run")
    assert good and str(good[-1]) == summary["checkpoint"]
    state = json.loads((good[-1] / rundir.STATE).read_text())
    losses = _train_losses(tmp_path / "run" / "metrics.jsonl")
    assert state["step"] == len(losses) and all(map(lambda v: v == v and abs(v) < float("inf"), losses))
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.slow
def test_causal_lm_model_saved_loads_without_sebp(tmp_path):
    s = ft.finetune(_cfg(tmp_path, max_steps=4), load_fn=_loader("llama"), data=synthetic_data("causal-lm"))
    assert s["final_eval"]["eval_perplexity"] > 1
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert not any(isinstance(x, SEBPLinear) for x in m.modules())
    cfgjson = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert cfgjson["config"]["max_steps"] == 4 and "torch" in cfgjson["versions"]


@pytest.mark.slow
def test_epochs_and_dynamic_padding(tmp_path):
    data = synthetic_data("classification", n=96)  # 12 batches of 8: half an epoch is 6 steps
    s = ft.finetune(_cfg(tmp_path, max_steps=None, epochs=0.5, data=DataConfig(max_length=24, batch_size=8,
                                                                                 padding="longest")),
                    load_fn=_loader("bert"), data=data)
    assert s["status"] == "completed" and s["steps"] == s["total_steps"] == 6
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in recs if r["type"] == "train"]
    assert all(r["epoch"] == 0 for r in train)
    assert all(r["rows"] % 8 == 0 and r["tokens"] <= r["rows"] for r in train)
    assert min(r["rows"] for r in train) < 8 * 24  # padded to the batch's longest, not to max_length


def test_second_signal_interrupts_at_once():
    before = signal.getsignal(signal.SIGINT)  # pytest-xdist workers ignore SIGINT; plain pytest has the default
    with loop.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_calibration_times_both_backends_on_cuda_only():
    from sebp_kernels import SEBPConfig
    from sebp_probe.train.calibration import backend_variants as _backend_variants

    layers = {"a": SEBPConfig("exact"), "b": SEBPConfig("threshold", eps=1e-6)}
    assert _backend_variants(layers, torch.device("cpu")) == [layers]
    variants = _backend_variants(layers, torch.device("cuda"))
    assert [v["a"].backend for v in variants] == ["triton", "torch"]
    assert variants[1]["b"] == SEBPConfig("threshold", eps=1e-6, backend="torch")
    pinned = {"a": SEBPConfig("exact", backend="torch")}
    assert _backend_variants(pinned, torch.device("cuda")) == [pinned]


def test_the_fastest_implementation_is_chosen_by_its_whole_step():
    """Of two SEBP implementations, calibration keeps the one whose forward + backward is faster, though its
    backward alone is the slower one."""
    from dataclasses import replace

    model = tiny_model("bert")
    cands = calibration.candidate_layers(model, FinetuneConfig(), None)
    variants = [{n: replace(c, backend=b) for n, c in cands.items()} for b in ("torch", "triton")]

    def timed(_batch):
        sebp = [m for m in model.modules() if isinstance(m, SEBPLinear)]
        if not sebp:
            return 2.0, 2.0
        return (3.0, 1.0) if sebp[0].sebp_config.backend == "torch" else (1.0, 2.0)

    chosen, dense, sebp = calibration._fastest_variant(model, [{}], False, False, 2, timed, variants,
                                                       lambda _b: None)
    assert chosen == variants[1] and dense == [(2.0, 2.0)] * 2 and sebp == [(1.0, 2.0)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compare_frees_the_first_run_before_the_second(tmp_path, precision):
    """The dense run's model must be gone when the SEBP run starts, or its memory inflates SEBP's peak."""
    import gc

    alive = {}

    def on_event(kind, payload):
        if kind == "start" and payload["run"] == "sebp":  # counted without a collection on purpose
            alive["n"] = sum(type(o).__name__ == "BertForSequenceClassification" for o in gc.get_objects())

    ft.finetune(_cfg(tmp_path, compare=True, max_steps=2, precision=precision), load_fn=_loader("bert"),
                data=synthetic_data("classification"), on_event=on_event)
    assert alive["n"] == 1


@pytest.mark.slow
def test_training_loop_waits_for_the_device_only_at_boundaries(tmp_path, monkeypatch):
    """The loop's one wait per step is the loss; it synchronizes the device besides only before the first step
    and after steps that something else follows (evaluation, checkpoint): the optimizer's work and the next
    batch's copy overlap the host's next step. Each step's time is still logged."""
    syncs, steps = [], []
    real = loop.sync
    monkeypatch.setattr(loop, "sync", lambda dev: syncs.append(len(steps)) or real(dev))

    def on_event(kind, p):
        if kind == "start":
            syncs.clear()  # calibration's timing synchronizes as it must
        elif kind == "step":
            steps.append(p["step"])

    cfg = _cfg(tmp_path, max_steps=9, eval_steps=4, save_steps=3)
    s = ft.finetune(cfg, load_fn=_loader("bert"), data=synthetic_data("classification"), on_event=on_event)
    assert s["status"] == "completed" and steps == list(range(1, 10))
    # before step 1; after steps 3 and 6 (checkpoints), 4 and 8 (evaluations) and 9 (evaluation, the end)
    assert syncs == [0, 2, 3, 5, 7, 8]
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"train"' in x]
    assert len(recs) == 9 and all(r["step_ms"] > 0 and r["tokens"] > 0 for r in recs)
    assert all(r["tokens"] <= r["rows"] for r in recs)


def test_optimizer_is_fused_and_steps_as_the_default_adamw(tmp_path):
    cfg = _cfg(tmp_path)
    cpu = loop.make_optimizer([torch.nn.Parameter(torch.ones(3))], cfg)
    assert isinstance(cpu, torch.optim.AdamW) and cpu.defaults.get("fused") is True
    assert cpu.defaults["lr"] == cfg.lr and cpu.defaults["weight_decay"] == cfg.weight_decay
    if torch.cuda.is_available():
        gpu = loop.make_optimizer([torch.nn.Parameter(torch.ones(3, device="cuda"))], cfg)
        assert gpu.defaults["fused"] is True
    # the same update rule as torch's default AdamW, step after step
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(5)]
    runs = []
    for make in (lambda ps: loop.make_optimizer(ps, cfg),
                 lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(ps)
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = g.clone()
            opt.step()
        runs.append(ps)
    for a, b in zip(*runs):
        assert not torch.equal(a, start[0] if a.dim() == 2 else start[1])
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_sebp_first_trains_the_same_two_runs_in_the_other_order(tmp_path):
    """--sebp-first only swaps the order: each run (dropout on) gives the losses it gives in the usual order,
    bit for bit on the CPU, and the summary lists dense first and says the order."""
    data = synthetic_data("classification")
    load = _loader("bert", dropout=0.1)
    starts = []
    on_event = lambda kind, p: starts.append(p["run"]) if kind == "start" else None  # noqa: E731
    usual = ft.finetune(_cfg(tmp_path / "a", compare=True, max_steps=6), load_fn=load, data=data)
    swapped = ft.finetune(_cfg(tmp_path / "b", compare=True, max_steps=6, sebp_first=True), load_fn=load, data=data,
                          on_event=on_event)
    assert starts == ["sebp", "dense"]
    assert usual["order"] == ["dense", "sebp"] and swapped["order"] == ["sebp", "dense"]
    assert list(swapped["runs"]) == ["dense", "sebp"] and swapped["status"] == "completed"
    for m in ("dense", "sebp"):
        got = _train_losses(tmp_path / "b" / "run" / m / "metrics.jsonl")
        assert len(got) == 6 and got == _train_losses(tmp_path / "a" / "run" / m / "metrics.jsonl")
    assert swapped["comparison"]["max_abs_loss_gap"] == usual["comparison"]["max_abs_loss_gap"]
    with pytest.raises(ValueError, match="add --compare"):
        _cfg(tmp_path / "c", sebp_first=True)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_norms_and_activations_run_where_no_linear_qualifies(monkeypatch, arch):
    """Every row active (no linear under the fallback density): the SEBP norms and activations are still timed
    and kept when not slower, dropped with everything else when slower; either way the gradients are dense's."""
    from sebp_kernels import SEBPNorm
    from sebp_probe.model.patch import patched_activations

    task = "causal-lm" if arch == "llama" else "classification"
    batch = next(iter(train_data.make_loaders(FinetuneConfig(data=DataConfig(max_length=24, batch_size=8)),
                                              synthetic_data(task))[0]))
    model = tiny_model(arch)
    cands = calibration.candidate_layers(model, FinetuneConfig(), None)
    c = calibration.calibrate(model, [batch], cands, 0.0, torch.device("cpu"), if_slower=False, norms=True,
                              acts=True)
    assert c.layers == {} and not any(isinstance(x, SEBPLinear) for x in model.modules())
    assert c.norms and c.norms == [n for n, m in model.named_modules() if isinstance(m, SEBPNorm)]
    assert patched_activations(model) and c.sebp_backward_ms is not None
    real = calibration.timed_step

    def slower_norms(m, b, d, a, h):  # the fused kernels measure slower (by a second: 1 ms was within a loaded
        fwd, bwd = real(m, b, d, a, h)  # CPU's noise)
        return fwd, bwd + (1e3 if any(isinstance(x, SEBPNorm) for x in m.modules()) else 0.0)

    monkeypatch.setattr(calibration, "timed_step", slower_norms)
    model = tiny_model(arch)
    c = calibration.calibrate(model, [batch], cands, 0.0, torch.device("cpu"), if_slower=True, norms=True,
                              acts=True)
    assert c.norms == [] and c.reason and not any(isinstance(x, SEBPNorm) for x in model.modules())
    assert not patched_activations(model)


def test_the_labelled_rows_heads_checks_wait_for_the_steps_own_wait(tmp_path, monkeypatch):
    """A causal-LM step with the labelled-rows head reads its labels' checks after the wait for the loss, not in
    the forward (no host sync there): the batches carry their counts, each check is held on the device
    (``label_checks.Deferred.add``) and read once a step (``check``), before the optimizer step. A bad label
    then stops the run with the one-line error, and no parameter changes."""
    from sebp_kernels import label_checks

    events = []
    add, check = label_checks.Deferred.add, label_checks.Deferred.check
    monkeypatch.setattr(label_checks.Deferred, "add", lambda self, *a: (events.append("add"), add(self, *a))[1])
    monkeypatch.setattr(label_checks.Deferred, "check", lambda self: (events.append("check"), check(self))[1])
    cfg = _cfg(tmp_path, max_steps=2, head="labelled",
               data=DataConfig(max_length=24, batch_size=4, padding="longest"))
    s = ft.finetune(cfg, load_fn=_loader("llama"), data=synthetic_data("causal-lm", n=16))
    assert s["status"] == "completed" and s["head"] == "labelled"
    steps = "".join("a" if e == "add" else "c" for e in events)
    assert steps.count("aac") >= 2  # each step: the head's and the loss's checks held, then one read

    model = {}

    def corrupt(self, *a):  # the step's labels as if from another vocabulary: one label past the end
        labels, bad, kept, count, vocab, ignore = a
        wrong = labels.clone()
        wrong[kept.nonzero()[0]] = vocab + 5
        return add(self, wrong, kept & (wrong >= vocab) | bad, kept, count, vocab, ignore)

    monkeypatch.setattr(label_checks.Deferred, "add", corrupt)
    loaded = _loader("llama")

    def load():
        out = loaded()
        model["m"] = out.model
        model["before"] = [p.detach().clone() for p in out.model.parameters()]
        return out

    with pytest.raises(ValueError, match=r"^label \d+ is outside \[0, \d+\) \(and is not ignore_index -100\)$"):
        ft.finetune(_cfg(tmp_path / "bad", max_steps=2, head="labelled",
                         data=DataConfig(max_length=24, batch_size=4, padding="longest")),
                    load_fn=load, data=synthetic_data("causal-lm", n=16))
    assert all(torch.equal(p, q) for p, q in zip(model["m"].parameters(), model["before"]))


@pytest.mark.parametrize("padding", ["longest", "packed"])
def test_the_cce_head_trains_as_the_models_own_loss(tmp_path, padding, monkeypatch):
    """``--head cce`` (the backbone, then Cut-Cross-Entropy on the labelled rows; its CPU implementation here) trains
    a tiny Llama step for step as the model's own loss does, SEBP on its linears, on padded and packed batches;
    the held-out loss of the same run is the model's own."""
    cce = pytest.importorskip("cut_cross_entropy")
    calls, real = [], cce.linear_cross_entropy
    monkeypatch.setattr(cce, "linear_cross_entropy", lambda *a, **k: (calls.append(k["impl"]), real(*a, **k))[1])
    runs = {}
    for head in ("full", "cce"):
        cfg = _cfg(tmp_path / head, max_steps=3, head=head, data=DataConfig(max_length=24, batch_size=4,
                                                                            padding=padding))
        s = ft.finetune(cfg, load_fn=_loader("llama"), data=synthetic_data("causal-lm", n=16))
        assert s["status"] == "completed" and s["head"] == head, s.get("head_fallback_reason")
        runs[head] = (_train_losses(tmp_path / head / "run" / "metrics.jsonl"), s["final_eval"]["eval_loss"])
    assert len(runs["cce"][0]) == 3 and len(calls) >= 3 and set(calls) == {"torch_compile"}  # the cce run's steps
    assert max(abs(a - b) for a, b in zip(*(runs[h][0] for h in runs))) < 1e-4
    assert runs["cce"][1] == pytest.approx(runs["full"][1], rel=1e-4)
