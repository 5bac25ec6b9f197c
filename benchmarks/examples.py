"""The example outputs of README.md: run the commands on the bundled assets and keep what they print.

    python benchmarks/examples.py            # writes results/examples/{analyze,finetune}.json

Each file holds the command, the machine, the versions, the date and the command's standard output (100
columns, as piped); `python tools/docs/make_docs.py` puts it into README.md.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sebp_probe.train.rundir import versions  # noqa: E402

EXAMPLES = {
    "analyze": ["analyze", "minilm", "tweets", "--max-batches", "4"],
    "finetune": ["finetune", "minilm", "tweets", "--max-steps", "30", "--max-samples", "2000",
                 "--eval-samples", "200", "-o", "{tmp}/run"],
}


def main() -> None:
    out_dir = ROOT / "results" / "examples"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COLUMNS": "100", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name, args in EXAMPLES.items():
        with tempfile.TemporaryDirectory() as tmp:
            args = [a.format(tmp=tmp) for a in args]
            proc = subprocess.run([sys.executable, "-m", "sebp_probe", *args], capture_output=True, text=True,
                                  env=env, cwd=ROOT, check=True)
            stdout = proc.stdout.replace(f"{tmp}/run", "runs/example")
        shown = [a if not a.startswith("/") else "runs/example" for a in args]
        record = {"command": "sebp-probe " + " ".join(shown),
                  "environment": {"device": f"CPU ({platform.processor() or platform.machine()}, "
                                            f"{os.cpu_count()} cores)", **versions(),
                                  "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")},
                  "stdout": stdout}
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote results/examples/{name}.json")


if __name__ == "__main__":
    main()
