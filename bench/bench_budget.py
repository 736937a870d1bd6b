"""`--time-budget`: does a run end on time, at its schedule's end, and how good is its model?

    python bench/bench_budget.py                                 # small preset, 3m (the issue's)
    python bench/bench_budget.py --preset tiny --budget 60s      # a loaded machine's check
    python bench/bench_budget.py --compare --json bench/results/budget-compare.json

One train.py process with `make pretrain`'s recipe (the embedded corpus, the repo's tokenizer,
batch 16 x 256, WSD), timed from its launch to its exit (the exports included); it reports the
wall time against the budget, the plan and re-plans it printed, its last step and that step's lr
(--min-lr: the decay landed on it), and the final validation loss and bits per byte.

--compare runs, one after another, on the same recipe:
  idle      the budget run alone;
  stopped   the same recipe with a fixed --max-steps (`make pretrain-small`'s 140) killed by
            SIGTERM at the budget's wall time, as a job's time limit does: its model at the step
            it reached, never decayed (scored by running it again to that step with
            --eval-every there: the runs are deterministic);
  loaded    the budget run again with that scoring run beside it (two trainings on 2 cores);
  fixed     the recipe with --max-steps set to the steps the idle budget run took: a fixed-steps
            run that guessed the machine's speed right, timed and scored alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--dataset", "sample", "--tokenizer", str(ROOT / "tokenizer" / "tokenizer.json")]
RECIPE += ["--seq-length", "256", "--batch-size", "16", "--lr-schedule", "wsd", "--log-every", "10"]
FIXED_STEPS = 140  # make pretrain-small's SMALL_STEPS
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]]


def command(preset: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--preset", preset, *RECIPE, *extra,
            "--out-dir", out]  # fmt: skip


def records(out: str) -> list[dict]:
    path = Path(out, "metrics.jsonl")
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def timed_run(preset: str, *extra: str) -> tuple[dict, str]:
    """(figures, stdout) of one run to its end, timed from launch to exit."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        result = subprocess.run(
            command(preset, out, *extra), env=ENV, capture_output=True, text=True
        )
        wall = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(
                f"{extra}: exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        rows = records(out)
    last = [r for r in rows if "loss" in r][-1]
    final = [r for r in rows if "val_bpb" in r][-1]
    figures = {"wall_s": round(wall, 1), "last_step": last["step"], "last_lr": last["lr"]}
    figures |= {"val_loss": round(final["val_loss"], 4), "val_bpb": round(final["val_bpb"], 4)}
    return figures | {"cpu_load_1min": os.getloadavg()[0]}, result.stdout


def budget_run(preset: str, budget: str) -> dict:
    figures, stdout = timed_run(preset, "--time-budget", budget)
    plans = re.findall(r"time budget: (?:plan|re-planned at step \d+): .*", stdout)
    for line in plans:
        print(line)
    over = 100 * (figures["wall_s"] - seconds(budget)) / seconds(budget)
    return {"budget_s": seconds(budget), "over_budget_pct": round(over, 1), "plans": len(plans),
            **figures}  # fmt: skip


def stopped_run(preset: str, wall_s: float) -> int:
    """The step a FIXED_STEPS run reached when SIGTERM came at ``wall_s`` after its launch."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen(command(preset, out, "--max-steps", str(FIXED_STEPS)), env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        return [r for r in records(out) if "loss" in r][-1]["step"]


def scoring_run(preset: str, step: int, out: str) -> subprocess.Popen:
    """The FIXED_STEPS run again, evaluated at ``step`` (`scored` reads it, then stops it)."""
    extra = ["--max-steps", str(FIXED_STEPS), "--eval-every", str(step)]
    return subprocess.Popen(command(preset, out, *extra), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip


def scored(proc: subprocess.Popen, out: str, step: int) -> dict:
    while True:
        found = [r for r in records(out) if r.get("step") == step and "val_bpb" in r]
        if found or proc.poll() is not None:
            break
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    return {"step": step, "val_loss": round(found[0]["val_loss"], 4),
            "val_bpb": round(found[0]["val_bpb"], 4)}  # fmt: skip


def compare(preset: str, budget: str) -> dict:
    idle = budget_run(preset, budget)
    print("idle", json.dumps(idle), flush=True)
    step = stopped_run(preset, seconds(budget))
    print("stopped at step", step, flush=True)
    with tempfile.TemporaryDirectory() as out:
        proc = scoring_run(preset, step, out)
        loaded = budget_run(preset, budget)
        print("loaded", json.dumps(loaded), flush=True)
        stopped = scored(proc, out, step)
    print("stopped", json.dumps(stopped), flush=True)
    fixed, _ = timed_run(preset, "--max-steps", str(idle["last_step"]))
    print("fixed", json.dumps(fixed), flush=True)
    return {"preset": preset, "budget": budget, "idle": idle, "loaded": loaded,
            "stopped": stopped, "fixed": fixed}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--budget", default="3m")
    p.add_argument("--compare", action="store_true", help="the four runs of the docstring")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    if args.compare:
        figures = compare(args.preset, args.budget)
    else:
        figures = {"preset": args.preset, **budget_run(args.preset, args.budget)}
    print(json.dumps(figures))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
