"""The model family and `--model-size auto`: the learning-rate rule, the loss fit auto predicts
with, and the sweep of budgets that checks its choice (issue 54).

    python bench/bench_size.py lr --json bench/results/size-lr-cpu.json
    python bench/bench_size.py fit --json bench/results/size-fit-cpu.json
    python bench/bench_size.py sweep --json bench/results/size-sweep-cpu.json
    python bench/bench_size.py sweep --budgets 10m,60m --fixed base --seq-length 1024 \\
        --batch-size 64 --dataset /data/fineweb-10BT --tokenizer /data/tokenizer.json \\
        --json bench/results/size-sweep-gpu.json          # a GPU: a corpus of 1B+ tokens

Every run is train.py itself, `make pretrain`'s recipe (the embedded corpus, the repo's
tokenizer, batch 16 x 256, WSD) with its final evaluation, save and export, no periodic ones; a
run's figure is its final validation bits per byte. The results are written to --json after
every run (a sweep in the background can be read while it runs, and --resume skips the runs
it holds).

lr     fixed-steps runs of family members at the rule's learning rate times 0.5, 1 and 2
       (--lr-grid): is the rule's lr near each member's best?
fit    fixed-steps runs of family members over a grid of steps (--fit-grid): the points
       (non-embedding parameters N, tokens D, val bpb) and the fit L = E + A/N^alpha + B/D^beta
       that train/sizing/law.py keeps (the losses of fixed-steps runs do not depend on the
       machine's load: only their times do, so this grid can run beside other work).
steps  the step time of family members and presets (--models), in this process, a step of each
       in turn over --rounds rounds: each one's median and fastest, and its ratio to the
       first's (the median of the per-round ratios: a busy spell slows a round's steps alike).
       make pretrain-small's steps: 140 small steps' time in steps of the member it trains.
sweep  for each budget (--budgets): --model-size auto, the fixed family sizes near it
       (--depths, else the chosen depth and its neighbours, d-1, d, d+1) and the --fixed
       presets, each a --time-budget run of the same recipe, their order rotating from round
       to round, budgets interleaved; auto's choice, its runner-up and each run's val bpb.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_ddp.model.config import LlamaConfig  # noqa: E402
from llama_ddp.model.family import lr_scale, member_shape  # noqa: E402
from llama_ddp.train.sizing.law import fit_loss  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
# A fixed-steps run's loss does not depend on the machine's speed: `fit` and `lr` may run as two
# queues side by side (OMP_NUM_THREADS=1 each); `sweep`'s runs are timed and run alone.
MUON_LR = 4e-3  # the optimizer's default, which the family's rule scales


def recipe(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset", args.dataset, "--tokenizer", str(args.tokenizer),
        "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
        "--lr-schedule", "wsd", "--log-every", "10", *shlex.split(args.train_flags),
    ]  # fmt: skip


def model_flags(model: str) -> list[str]:
    """``auto``, a depth (``d3``) or a preset (``small``) as train.py's flags."""
    if model == "auto":
        return ["--model-size", "auto"]
    if model.startswith("d"):
        return ["--model-size", model[1:]]
    return ["--preset", model]


def train(args: argparse.Namespace, model: str, *extra: str) -> dict:
    """One train.py run to its end, timed from launch to exit: its figures."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(ROOT / "train.py"), *model_flags(model), *recipe(args),
                   *extra, "--out-dir", out]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, env=ENV, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"{model} {extra}: exit {result.returncode}\n{result.stderr[-3000:]}")
        rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
        config = json.loads(Path(out, "llama_model.json").read_text())
    steps = [r for r in rows if "loss" in r]
    final = [r for r in rows if "val_bpb" in r][-1]
    figures = {
        "model": model, "wall_s": round(wall, 1), "steps": steps[-1]["step"],
        "tokens": steps[-1]["tokens"], "val_loss": round(final["val_loss"], 4),
        "val_bpb": round(final["val_bpb"], 4), "parameters": counts(config)[0],
        "non_embedding": counts(config)[1], "hidden_size": config["hidden_size"],
        "layers": config["num_hidden_layers"], "load_1min": round(os.getloadavg()[0], 2),
        "peak_lr": max((r["lr"] for r in steps), default=None),
    }  # fmt: skip
    chosen = re.search(r"model size: auto chose depth (\d+).*", result.stdout)
    if chosen:
        figures["chosen"] = chosen[0]
        runner = re.search(r"runner-up: depth (\d+)", chosen[0])
        figures["runner_up"] = int(runner[1]) if runner else None
        timed = re.search(
            r"model size: a step timed of each candidate \((.*)\) took (\S+) s", result.stdout
        )
        figures["timed"], figures["timing_s"] = timed[1], float(timed[2])
    return figures


def counts(config: dict) -> tuple[int, int]:
    """A run's (parameters, non-embedding parameters: the decoder layers and the final norm)
    from its llama_model.json."""
    shape = LlamaConfig.from_dict(config)
    embeddings = (1 if shape.tie_word_embeddings else 2) * shape.vocab_size * shape.hidden_size
    return shape.num_parameters(), shape.num_parameters() - embeddings


class Results:
    """The figures so far, written to --json after every run."""

    def __init__(self, path: Path | None, header: dict, resume: bool) -> None:
        self.path, self.data = path, {**header, "runs": []}
        if resume and path is not None and path.exists():
            self.data["runs"] = json.loads(path.read_text())["runs"]

    def has(self, key: dict) -> dict | None:
        return next((r for r in self.data["runs"] if all(r.get(k) == v for k, v in key.items())),
                    None)  # fmt: skip

    def add(self, figures: dict) -> None:
        self.data["runs"].append(figures)
        print(json.dumps(figures), flush=True)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1) + "\n")


# ----------------------------------------------------------------------------- lr


def lr_sweep(args: argparse.Namespace, results: Results) -> None:
    for depth, steps in args.lr_grid:
        for mult in args.lr_mults:
            key = {"depth": depth, "lr_mult": mult, "steps": steps}
            if results.has(key):
                continue
            width = member_shape(depth)["hidden_size"]
            lr = MUON_LR * lr_scale(width) * mult
            figures = train(args, f"d{depth}", "--max-steps", str(steps), "--lr", f"{lr:.6g}",
                            "--no-export-hf")  # fmt: skip
            results.add({**key, "rule_lr": MUON_LR * lr_scale(width), **figures, "peak_lr": lr})


# ----------------------------------------------------------------------------- fit


def fit_runs(args: argparse.Namespace, results: Results) -> None:
    for depth, steps in args.fit_grid:
        key = {"depth": depth, "max_steps": steps}
        if results.has(key):
            continue
        figures = train(args, f"d{depth}", "--max-steps", str(steps), "--no-export-hf")
        results.add({**key, **figures})
    points = [(r["non_embedding"], r["tokens"], r["val_bpb"]) for r in results.data["runs"]]
    law = fit_loss(points)
    predicted = [law(n, d) for n, d, _ in points]
    results.data["fit"] = {
        **dataclasses.asdict(law), "points": len(points),
        "worst_rel_err": max(abs(p / loss - 1) for p, (_, _, loss) in zip(predicted, points)),
    }  # fmt: skip
    results.write()
    print(json.dumps(results.data["fit"]))


# ----------------------------------------------------------------------------- steps


def step_times(args: argparse.Namespace, results: Results) -> None:
    import statistics

    import torch

    from llama_ddp.distributed import runtime as D
    from llama_ddp.train.config import TrainConfig
    from llama_ddp.train.run import build_trainer

    trainers, feeds = {}, {}
    for model in args.models:
        flags = {"model_size": model[1:]} if model.startswith("d") else {"preset": model}
        cfg = TrainConfig.from_flags(
            **flags, dataset=(args.dataset,), tokenizer=str(args.tokenizer),
            seq_length=args.seq_length, batch_size=args.batch_size, max_steps=10**6,
            out_dir=tempfile.mkdtemp(), lr_schedule="wsd",
        ).validate()  # fmt: skip
        trainers[model] = build_trainer(cfg, D.setup("single", "cpu"))
        feeds[model] = trainers[model].data.batches(0)
        trainers[model].step(next(feeds[model])).stats()  # warm-up
    times: dict[str, list[float]] = {m: [] for m in args.models}
    for rnd in range(args.rounds):
        order = args.models[rnd % len(args.models) :] + args.models[: rnd % len(args.models)]
        for model in order:
            batch = next(feeds[model])
            start = time.perf_counter()
            trainers[model].step(batch).stats()
            times[model].append(time.perf_counter() - start)
    first = args.models[0]
    for model in args.models:
        ratio = statistics.median(t / f for t, f in zip(times[model], times[first]))
        results.add({"model": model, "median_s": round(statistics.median(times[model]), 4),
                     "fastest_s": round(min(times[model]), 4), "ratio_to_first": round(ratio, 4),
                     "parameters": trainers[model].model.num_parameters(),
                     "threads": torch.get_num_threads()})  # fmt: skip


# ----------------------------------------------------------------------------- sweep


def sweep(args: argparse.Namespace, results: Results) -> None:
    for rnd in range(args.rounds):
        for i, budget in enumerate(args.budgets):
            models = ["auto"]
            chosen = [r.get("chosen_depth") for r in results.data["runs"]
                      if r["budget"] == budget and r["model"] == "auto"]  # fmt: skip
            depths = args.depths.get(budget)
            if depths is None:  # auto first: its choice names the depths beside it
                auto = run_budget(args, results, budget, "auto", rnd)
                chosen.append(auto.get("chosen_depth"))
                depths = sorted({d + k for d in chosen if d for k in (-1, 0, 1) if d + k >= 1})
                models = []
            models += [f"d{d}" for d in depths] + args.fixed
            shift = (rnd + i) % len(
                models
            )  # the order rotates from budget to budget, round to round
            for model in models[shift:] + models[:shift]:
                run_budget(args, results, budget, model, rnd)


def run_budget(
    args: argparse.Namespace, results: Results, budget: str, model: str, rnd: int
) -> dict:
    key = {"budget": budget, "model": model, "round": rnd}
    done = results.has(key)
    if done:
        return done
    figures = train(args, model, "--time-budget", budget)
    if "chosen" in figures:
        figures["chosen_depth"] = int(re.search(r"depth (\d+)", figures["chosen"])[1])
    results.add({**key, **figures})
    return figures


def table(data: dict) -> str:
    """The sweep's table: each budget's runs by val bpb (median over rounds)."""
    lines = ["| budget | model | parameters | steps | tokens | val bpb | vs best fixed |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for budget in dict.fromkeys(r["budget"] for r in data["runs"]):
        runs = [r for r in data["runs"] if r["budget"] == budget]
        by_model: dict[str, list[dict]] = {}
        for r in runs:
            by_model.setdefault(r["model"], []).append(r)
        median = {
            m: sorted(rs, key=lambda r: r["val_bpb"])[len(rs) // 2] for m, rs in by_model.items()
        }
        fixed = [r["val_bpb"] for m, r in median.items() if m.startswith("d")]
        best = min(fixed) if fixed else math.nan
        for m, r in sorted(median.items(), key=lambda kv: kv[1]["val_bpb"]):
            name = f"auto (chose d{r.get('chosen_depth')})" if m == "auto" else m
            gap = 100 * (r["val_bpb"] / best - 1)
            lines.append(
                f"| {budget} | {name} | {r['parameters'] / 1e6:.2f}M | {r['steps']} | "
                f"{r['tokens'] / 1e6:.2f}M | {r['val_bpb']:.4f} | {gap:+.1f}% |"
            )
    return "\n".join(lines)


def grid(text: str) -> list[tuple[int, int]]:
    """``1x150,2x150`` -> [(1, 150), (2, 150)]."""
    return [tuple(map(int, x.split("x"))) for x in text.split(",")]


def depths_arg(text: str) -> dict[str, list[int]]:
    """``1m:1,2,3,3m:2,3,4`` -> {"1m": [1, 2, 3], "3m": [2, 3, 4]}."""
    out: dict[str, list[int]] = {}
    budget = None
    for part in text.split(","):
        if ":" in part:
            budget, part = part.split(":")
            out[budget] = []
        out[budget].append(int(part))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["lr", "fit", "steps", "sweep", "table"])
    p.add_argument("--dataset", default="sample")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "tokenizer" / "tokenizer.json")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train-flags", default="", help="more of train.py's flags, one string")
    p.add_argument("--lr-grid", type=grid, default=[(1, 150), (2, 150), (6, 60)],
                   help="DEPTHxSTEPS,...")  # fmt: skip
    p.add_argument("--lr-mults", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 0.5, 2.0])  # fmt: skip
    p.add_argument("--fit-grid", type=grid,
                   default=grid("1x40,2x40,3x40,4x40,5x40,1x160,2x160,3x160,4x160,5x160,1x640,"
                                "2x640,3x640,4x400"),
                   help="DEPTHxSTEPS,...")  # fmt: skip
    p.add_argument("--budgets", type=lambda s: s.split(","), default=["1m", "3m", "10m"])
    p.add_argument(
        "--depths",
        type=depths_arg,
        default={},
        help="BUDGET:D,D,...: the fixed depths (default: auto's choice and neighbours)",
    )
    p.add_argument("--fixed", type=lambda s: s.split(",") if s else [], default=["small"],
                   help="presets run beside them")  # fmt: skip
    p.add_argument("--models", type=lambda s: s.split(","), default="small,d1,d2,d3,d4".split(","),
                   help="steps: the models to time, the first the reference")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--resume", action="store_true", help="keep the runs --json holds")
    args = p.parse_args(argv)
    if args.what == "table":
        print(table(json.loads(args.json.read_text())))
        return 0
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")  # fmt: skip
    header = {"what": args.what, "cpu": cpu, "cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "recipe": recipe(args)}  # fmt: skip
    results = Results(args.json, header, args.resume)
    {"lr": lr_sweep, "fit": fit_runs, "steps": step_times, "sweep": sweep}[args.what](args, results)
    if args.what == "sweep":
        print(table(results.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
