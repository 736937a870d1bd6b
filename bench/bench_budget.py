"""`--time-budget`: does a run end on time, at its schedule's end, and how good is its model?

    python bench/bench_budget.py                                 # small preset, 3m (the issue's)
    python bench/bench_budget.py --preset tiny --budget 60s      # a loaded machine's check

One train.py process with `make pretrain`'s recipe (the embedded corpus, the repo's tokenizer,
batch 16 x 256, WSD), timed from its launch to its exit (the exports included); it reports the
wall time against the budget, the plan and re-plans it printed, its last step and that step's lr
(--min-lr: the decay landed on it), and the final validation loss and bits per byte.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--dataset", "sample", "--tokenizer", str(ROOT / "tokenizer" / "tokenizer.json")]
RECIPE += ["--seq-length", "256", "--batch-size", "16", "--lr-schedule", "wsd", "--log-every", "10"]


def seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--budget", default="3m")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "train.py"), "--preset", args.preset, *RECIPE]
        cmd += ["--time-budget", args.budget, "--out-dir", out]
        start = time.perf_counter()
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            print(result.stdout[-2000:] + result.stderr[-2000:], file=sys.stderr)
            return result.returncode
        lines = Path(out, "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
    plans = re.findall(r"time budget: (?:plan|re-planned at step \d+): .*", result.stdout)
    last = [r for r in records if "loss" in r][-1]
    final = [r for r in records if "val_bpb" in r][-1]
    budget = seconds(args.budget)
    figures = {
        "preset": args.preset,
        "budget_s": budget,
        "wall_s": round(wall, 1),
        "over_budget_pct": round(100 * (wall - budget) / budget, 1),
        "plans": len(plans),
        "last_step": last["step"],
        "last_lr": last["lr"],
        "val_loss": round(final["val_loss"], 4),
        "val_bpb": round(final["val_bpb"], 4),
        "cpu_load_1min": os.getloadavg()[0],
    }
    for line in plans:
        print(line)
    print(json.dumps(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
