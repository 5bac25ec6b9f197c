"""Host time of the eager whole-model backward, dense vs SEBP, and where the SEBP layers' share of it goes.

    python scripts/host_in_model.py [bert-base] [--profile] [--all]

Times ``loss.backward()`` on the host (the GPU is idle when it starts, so this is the time to issue the
backward) on the padded batch of ``sebp-probe bench --scope model``; then the same with parts of the SEBP
path swapped for no-ops, to price them; with ``--profile``, a cProfile of the SEBP backward; with ``--all``,
the SEBP norms and activations too (host time, and they are in the profile).
"""
import cProfile
import gc
import pstats
import statistics
import sys
import time

import torch

from sebp_kernels import SEBPConfig
from sebp_probe.bench import DECODER_TARGETS, MODEL_CASES, _batch, _build_model, sample_lengths
from sebp_probe.patch import patch_model, unpatch_model


class _Ms(float):
    """Median host ms of the backward call, printed with the fastest and slowest."""

    def __format__(self, spec):
        return f"{float(self):{spec}} (min {self.lo:6.2f}, max {self.hi:6.2f})"


def host_ms(model, batch, repeats=15):
    """Host time of ``loss.backward()`` with the Python garbage collector held off during the call (its
    pauses otherwise add several milliseconds to some calls)."""
    out = []
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        torch.cuda.synchronize()
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        gc.enable()
        torch.cuda.synchronize()
        if i >= 2:
            out.append((t1 - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    ms = _Ms(statistics.median(out))
    ms.lo, ms.hi = min(out), max(out)
    return ms


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    name = next((a for a in sys.argv[1:] if not a.startswith("-")), "bert-base")
    case = MODEL_CASES[name]
    model = _build_model(case, torch.bfloat16)
    lengths = sample_lengths(case.lengths, case.batch, case.seq, seed=0)
    batch = _batch(case, lengths, case.seq, model.config.vocab_size, seed=0)
    targets = DECODER_TARGETS if case.arch != "bert" else None
    print(f"{name}: dense backward host {host_ms(model, batch):7.2f} ms")
    n = len(patch_model(model, SEBPConfig("exact"), target_modules=targets))
    base = host_ms(model, batch)
    print(f"{name}: SEBP  backward host {base:7.2f} ms ({n} SEBP layers)")
    cap = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False
    print(f"   without is_current_stream_capturing: {host_ms(model, batch):7.2f} ms")
    torch.cuda.is_current_stream_capturing = cap
    dens = {m: m._sebp_density for m in model.modules() if hasattr(m, "_sebp_density")}
    for m in dens:
        m._sebp_density = None
    print(f"   without RowDensity state:            {host_ms(model, batch):7.2f} ms")
    for m, s in dens.items():
        m._sebp_density = s
    from sebp_kernels import density

    choose, observe = density.RowDensity.choose, density.RowDensity.observe
    density.RowDensity.observe = lambda self, *a, **k: None
    print(f"   RowDensity.observe a no-op:          {host_ms(model, batch):7.2f} ms")
    density.RowDensity.observe = observe
    density.RowDensity.choose = lambda self, capturing=False: "sebp"
    print(f"   RowDensity.choose always 'sebp':     {host_ms(model, batch):7.2f} ms")
    density.RowDensity.choose = choose
    import warnings

    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        loss.backward()
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "sync" in str(w.message).lower()]
    print(f"   synchronizing calls in one SEBP backward: {len(syncs)}", syncs[:3])
    print(f"   SEBP again:                          {host_ms(model, batch):7.2f} ms")
    from sebp_kernels import zero_rows

    zero_rows.enable(True)
    print(f"   with dX kept (zero_rows.enable()):   {host_ms(model, batch):7.2f} ms")
    zero_rows.enable(False)
    ev = torch.cuda.Event()
    ev.record()
    a = torch.zeros(4, device="cuda")
    print(f"   per call: is_current_stream_capturing {per_call_us(torch.cuda.is_current_stream_capturing):5.1f} us, "
          f"Event.query {per_call_us(ev.query):5.1f} us, torch.empty {per_call_us(lambda: torch.empty(64, device='cuda')):5.1f} us, "
          f"slice {per_call_us(lambda: a[:2]):5.1f} us, current_stream {per_call_us(torch.cuda.current_stream):5.1f} us")
    if "--all" in sys.argv:
        from sebp_probe.patch import patch_activations, patch_norms

        n_norms, n_acts = len(patch_norms(model)), len(patch_activations(model))
        print(f"   + SEBP norms and activations:        {host_ms(model, batch):7.2f} ms ({n_norms} norms, "
              f"{n_acts} activations)")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            torch.cuda.synchronize()
            prof.enable()
            loss.backward()
            prof.disable()
            torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(28)
    unpatch_model(model)


if __name__ == "__main__":
    main()
