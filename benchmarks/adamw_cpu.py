"""CPU: one AdamW step over the bundled MiniLM's parameters, torch's default implementation against the fused
one that ``finetune`` uses (``sebp_probe.train.loop.make_optimizer``).

Usage: python benchmarks/adamw_cpu.py [--repeats 20] [--out results/tuning/adamw_cpu.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch  # noqa: E402

from sebp_probe.data.assets import load_model  # noqa: E402
from sebp_probe.train.rundir import device_name, versions  # noqa: E402


def step_ms(params: list[torch.nn.Parameter], repeats: int, **kwargs) -> float:
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kwargs)
    opt.step()  # allocates the state
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="results/tuning/adamw_cpu.json")
    args = parser.parse_args(argv)
    model = load_model("minilm", task="classification").model
    params = [p for p in model.parameters() if p.requires_grad]
    rows = {}
    for name, kwargs in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        rows[name] = step_ms([torch.nn.Parameter(p.detach().clone()) for p in params], args.repeats, **kwargs)
        print(f"{name:8s} {rows[name]:8.1f} ms")
    env = {"device": device_name(torch.device("cpu")),
           **versions(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": "python benchmarks/adamw_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": env, "parameters": sum(p.numel() for p in params),
                                          "median_step_ms": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
