"""Time to a good model: the training seconds a recipe needs to reach the baseline's final loss.

    python bench/bench_time_to_loss.py --step-rounds 10 --json bench/results/time-to-loss-cpu.json \
        --png docs/time_to_loss.png

The baseline is fp32 AdamW for 160 steps on the small preset and the embedded corpus (``--dataset
sample``, tokenizer/tokenizer.json, batch 32 x 256): its final validation loss is L0 and its
training time T0. Every other recipe (``--recipe NAME=FLAGS``; by default train.py's defaults and
make pretrain-small's recipe) trains the same model on the same data, and its time to L0 is the
training time at its first evaluation whose loss is at most L0, and linearly interpolated between
that evaluation and the one before it. Each run is train.py in a subprocess; its times are the
run's own accounting (metrics.jsonl, `metrics.TimeSpent`): training seconds are its training steps
plus its waits for data, evaluation and checkpoints excluded. On a shared machine the runs meet
different loads: ``--step-rounds N`` then times N steps of each recipe taking turns, and gives each
time to L0 as steps to L0 x its median step, over the baseline's 160 x its median step. Every
evaluation scores the same held-out windows (--eval-tokens), so the recipes are compared on the
same tokens. A run folder whose metrics.jsonl is complete is read, not trained again (``--fresh``
retrains): runs take minutes each. ``--device`` (default: cuda when a GPU is visible, else cpu)
runs every recipe, and the step timing, on that device; the baseline stays fp32 (TF32 on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import cpu_name  # noqa: E402

BASELINE = "--dtype fp32 --optimizer adamw --max-steps 160"
DEFAULT_RECIPES = [
    "defaults=--max-steps 160",  # train.py's defaults: Muon, cosine
    "pretrain-small=--batch-size 16 --max-steps 140 --lr-schedule wsd",  # the Makefile's
]
COMMON = (
    "--preset small --dataset sample --tokenizer tokenizer/tokenizer.json --seq-length 256 "
    "--batch-size 32 --save-every 0 --log-every 10 --no-export-hf"
)


def curve(out: Path) -> tuple[list[tuple[int, float, float]], dict] | None:
    """(step, training seconds, val_loss) of each evaluation of a finished run, and its final
    time record; None if the run did not finish."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records or set(records[-1]) != {"step", "time"}:
        return None
    points = [
        (r["step"], r["time"]["train_s"] + r["time"]["data_s"], r["val_loss"])
        for r in records
        if "val_loss" in r
    ]
    return points, records[-1]["time"]


def time_to(points: list[tuple[int, float, float]], target: float) -> dict | None:
    """When a curve first reaches ``target``: the step and seconds of that evaluation, and the
    step and seconds interpolated linearly (in loss) from the evaluation before it; None if
    never."""
    for i, (step, seconds, loss) in enumerate(points):
        if loss <= target:
            if i == 0:
                return {"step": step, "seconds": seconds, "interpolated_s": seconds,
                        "interpolated_step": step}  # fmt: skip
            step0, s0, l0 = points[i - 1]
            share = (l0 - target) / (l0 - loss) if l0 > loss else 1.0
            return {
                "step": step,
                "seconds": seconds,
                "interpolated_s": s0 + share * (seconds - s0),
                "interpolated_step": step0 + share * (step - step0),
            }
    return None


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_name(device: str) -> str:
    """The GPU's name on CUDA, else the CPU's."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return cpu_name()


def step_times(
    recipes: dict[str, str], rounds: int, cache_dir: str | None, device: str
) -> dict[str, list]:
    """Seconds of one optimizer step of each recipe on ``device``, the recipes taking turns step
    after step (a shared machine's load then falls on all of them alike): trainers built as
    train.py builds them, one warm-up step each; reading a step's results waits for the
    device."""
    import tempfile

    from llama_ddp.distributed import runtime as D
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    trainers, tmp = {}, Path(tempfile.mkdtemp())
    for name, flags in recipes.items():
        argv = [*shlex.split(COMMON), *shlex.split(flags), "--out-dir", str(tmp / name)]
        cfg = parse_train_args(argv + (["--cache-dir", cache_dir] if cache_dir else []))
        trainers[name] = build_trainer(cfg, D.setup("single", device))
    batches = {name: t.data.batches(0) for name, t in trainers.items()}
    seconds: dict[str, list] = {name: [] for name in trainers}
    for round_ in range(rounds + 1):
        for name, trainer in trainers.items():
            micro_batches = next(batches[name])
            start = time.perf_counter()
            trainer.step(micro_batches).stats()
            if round_:  # the first is the warm-up
                seconds[name].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.data.close()
    return seconds


def train(
    name: str, flags: str, out: Path, eval_every: int, cache_dir: str | None, device: str
) -> float:
    """Run train.py for one recipe into ``out`` on ``device``; the wall seconds it took."""
    cmd = [sys.executable, str(ROOT / "train.py"), *shlex.split(COMMON), *shlex.split(flags)]
    cmd += ["--eval-every", str(eval_every), "--out-dir", str(out), "--resume", "none"]
    cmd += ["--device", device]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def plot(runs: dict[str, dict], target: float, png: Path, machine: str) -> None:
    """Validation loss against training seconds: the runs' own, or with --step-rounds each
    evaluation's step times the recipe's median step (runs that met different loads on a shared
    machine, compared at one pace)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paced = all("step_s" in run for run in runs.values())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        if paced:
            seconds = [p[0] * run["step_s"]["median"] for p in run["points"]]
        else:
            seconds = [p[1] for p in run["points"]]
        losses = [p[2] for p in run["points"]]
        ax.plot(seconds, losses, marker="o", markersize=3, label=f"{name}: {run['flags']}")
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"L0 = {target:.3f}")
    ax.set_xlabel(
        "training seconds: steps x median step time, interleaved"
        if paced
        else "training seconds (evaluation excluded)"
    )
    ax.set_ylabel("validation loss")
    ax.set_ylim(target - 0.6, target + 2.5)
    ax.set_title(f"small preset, sample corpus, sequences of 256, {machine}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a recipe against the baseline: train.py flags over the common ones (default: "
        "train.py's defaults for 160 steps, and make pretrain-small's recipe)",
    )
    p.add_argument("--eval-every", type=int, default=20, help="the curve's resolution in steps")
    p.add_argument(
        "--out-dir", type=Path, help="the runs' folders (default: out/time_to_loss, -cuda on CUDA)"
    )
    p.add_argument("--cache-dir", help="train.py's --cache-dir")
    p.add_argument("--fresh", action="store_true", help="train again runs that finished")
    p.add_argument("--only", help="comma list of recipe names to train now (the rest are read)")
    p.add_argument(
        "--step-rounds",
        type=int,
        default=0,
        help="also time N optimizer steps of each recipe, taking turns, for a time to L0 that "
        "a shared machine's load does not skew: steps to L0 x seconds per step",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is visible")
    p.add_argument("--png", type=Path, help="draw validation loss against training seconds")
    p.add_argument("--json", type=Path, help="write the figures")
    args = p.parse_args()
    device = args.device or default_device()
    machine = machine_name(device)
    suffix = "" if device == "cpu" else f"-{device}"  # a CPU run's curve is not a GPU's
    out_dir = args.out_dir or ROOT / "out" / f"time_to_loss{suffix}"
    recipes = {"baseline": BASELINE}
    for spec in args.recipe or DEFAULT_RECIPES:
        name, _, flags = spec.partition("=")
        recipes[name] = flags
    only = set(args.only.split(",")) if args.only else set(recipes)
    runs: dict[str, dict] = {}
    for name, flags in recipes.items():
        out = out_dir / name
        if name in only and (args.fresh or curve(out) is None):
            wall = train(name, flags, out, args.eval_every, args.cache_dir, device)
            print(f"[{name}] {wall:.0f} s wall, load average now {os.getloadavg()}", flush=True)
        result = curve(out)
        if result is None:
            print(f"[{name}] no finished run in {out}", flush=True)
            continue
        points, spent = result
        runs[name] = {"flags": flags, "points": points, "time": spent}
    base = runs["baseline"]
    target, t0 = base["points"][-1][2], base["points"][-1][1]
    print(
        f"baseline: L0 = {target:.4f} (perplexity {2.718281828459045**target:.1f}), T0 = {t0:.1f} s"
    )
    for name, run in runs.items():
        reached = time_to(run["points"], target)
        run["to_target"] = reached
        final = run["points"][-1]
        line = f"{name}: final val_loss {final[2]:.4f} at {final[1]:.1f} s (step {final[0]})"
        if reached:
            ratio = reached["interpolated_s"] / t0
            run["ratio"] = ratio
            line += (
                f"; reaches L0 at step {reached['step']}: {reached['seconds']:.1f} s "
                f"(interpolated {reached['interpolated_s']:.1f} s) = {ratio:.2f} x T0"
            )
        else:
            line += "; never reaches L0"
        steps = [p[0] for p in run["points"] if p[0] > 0]
        if steps:
            run["s_per_step"] = final[1] / final[0]
            line += f" | {run['s_per_step']:.2f} training s/step"
        print(line, flush=True)
    if args.step_rounds:
        seconds = step_times(
            {n: r["flags"] for n, r in runs.items()}, args.step_rounds, args.cache_dir, device
        )
        base_step = statistics.median(seconds["baseline"])
        for name, run in runs.items():
            run["step_s"] = {
                "fastest": min(seconds[name]),
                "median": statistics.median(seconds[name]),
                "all": seconds[name],
            }
            fastest, median = run["step_s"]["fastest"], run["step_s"]["median"]
            line = f"{name}: one step {fastest:.2f} s fastest, {median:.2f} s median"
            if run.get("to_target"):
                steps = run["to_target"]["interpolated_step"]
                run["ratio_by_steps"] = (
                    steps * run["step_s"]["median"] / (base["points"][-1][0] * base_step)
                )
                line += f"; {steps:.0f} steps to L0 -> {run['ratio_by_steps']:.2f} x T0"
            end = run["points"][-1][0]  # the whole run: the model it saves
            run["end_by_steps"] = end * median / (base["points"][-1][0] * base_step)
            line += f"; its {end} steps -> {run['end_by_steps']:.2f} x T0"
            print(line, flush=True)
    if args.png:
        plot(runs, target, args.png, machine)
        print(f"wrote {args.png}")
    if args.json:
        doc = {
            "machine": machine,
            "device": device,
            "threads": os.cpu_count(),
            "load_average": os.getloadavg(),
            "L0": target,
            "T0": t0,
            "runs": runs,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
