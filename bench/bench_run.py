"""What a user's run costs: ``python train.py`` itself, at its defaults and with other flags,
measured from its own metrics.jsonl (make bench-gpu).

    python bench/bench_run.py --device cuda                       # base, 1024 x 64, 40 steps
    python bench/bench_run.py --runs "defaults;--optimizer adamw" --json out.json
    python bench/bench_run.py --device cpu --preset tiny --seq-length 128 --batch-size 8 --steps 10

Each run is one train.py process (``--dataset sample``, the repo's tokenizer, --save-every half the
steps so one checkpoint is taken mid-run), on a warm token cache (a first, one-step run of the
tiny preset builds it, in train.py's cache folder unless --cache-dir says otherwise). Per run:
tokens/s and MFU at steady state (the median of the step lines after the first half of the
steps); tokens/s of the second step line (the first includes step 1: compiled runs warm up after
it); the time to the first step (since the process started, imports included) and the first
step's excess over a steady one (mostly compiling); the share of the loop spent waiting for
data; the seconds the mid-run checkpoint kept training waiting and those it took to complete;
the peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_ddp.train.speed import PHASES  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="base")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument(
        "--runs",
        default="defaults;--optimizer adamw",
        help="the runs, separated by ';': train.py's extra flags each ('defaults': none)",
    )
    p.add_argument("--tokenizer", default=str(ROOT / "tokenizer" / "tokenizer.json"))
    p.add_argument("--cache-dir", type=Path, default=None, help="default: train.py's")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def command(args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, str(ROOT / "train.py"), "--preset", args.preset, "--dataset", "sample",
        "--tokenizer", args.tokenizer, "--seq-length", str(args.seq_length),
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
        "--log-every", str(args.log_every), "--save-every", str(args.steps // 2),
        "--eval-tokens", "4096", "--no-export-hf", "--device", args.device,
        "--out-dir", str(out), *(["--cache-dir", str(args.cache_dir)] if args.cache_dir else []),
        *extra,
    ]  # fmt: skip


def launch(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run ``cmd`` offline (and with ``env``); its wall seconds and its output (an error with its
    tail if it failed)."""
    start = time.perf_counter()
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )
    if result.returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)} exited {result.returncode}:\n"
                         f"{result.stdout[-2000:]}{result.stderr[-3000:]}")  # fmt: skip
    return time.perf_counter() - start, result.stdout


def summarize(records: list[dict], steps: int, wall_s: float) -> dict:
    """The figures of one run from its metrics.jsonl records."""
    lines = [r for r in records if "loss" in r]
    steady = [r for r in lines if r["step"] > steps // 2]
    first = next(r for r in records if "first_step_s" in r)
    early = lines[1] if len(lines) > 1 else None  # the first window without step 1
    saves = [r for r in records if "save_s" in r]
    mid = next((r for r in saves if r["step"] < steps), None)
    final = next((r for r in saves if r["step"] == steps), None)
    spent = next(r["time"] for r in reversed(records) if "time" in r and "loss" not in r)
    loop = sum(spent[k] for k in PHASES)
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    step_s = statistics.median(
        (b["tokens"] - a["tokens"]) / b["tokens_per_s"] / (b["step"] - a["step"])
        for a, b in zip(steady, steady[1:])
    ) if len(steady) > 1 else None  # fmt: skip
    memory = [r["max_memory_allocated"] for r in lines if "max_memory_allocated" in r]
    return {
        "tokens_per_s": tps,
        "mfu": statistics.median(r["mfu"] for r in steady),
        "early_tokens_per_s": early["tokens_per_s"] if early else None,
        "early_window": [lines[0]["step"] + 1, early["step"]] if early else None,
        "first_step_s": first.get("process_s", first["first_step_s"]),
        "first_step_loop_s": first["first_step_s"],
        "compile_s": first["first_step_s"] - step_s if step_s else None,
        "step_s": step_s,
        "data_wait_s": spent["data_s"],
        "data_wait_share": spent["data_s"] / loop if loop else None,
        "checkpoint_blocked_s": mid["save_blocked_s"] if mid else None,
        "checkpoint_s": mid["save_s"] if mid else None,
        "final_checkpoint_s": final["save_s"] if final else None,
        "max_memory_allocated": max(memory) if memory else None,
        "wall_s": wall_s,
        "time": spent,
    }


def table(results: dict[str, dict]) -> str:
    rows = [
        ("tokens/s (steady)", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("MFU (steady)", lambda r: f"{100 * r['mfu']:.1f}%"),
        ("tokens/s, the second log window", _early),
        ("time to first step (process start)", lambda r: f"{r['first_step_s']:.1f} s"),
        ("first step - a steady step (compiling)", lambda r: _seconds(r["compile_s"])),
        ("waiting for data", lambda r: f"{r['data_wait_s']:.2f} s ({_share(r)})"),
        ("mid-run checkpoint: blocked / complete", _checkpoint),
        ("final checkpoint (waited for)", lambda r: _seconds(r["final_checkpoint_s"])),
        ("peak memory", lambda r: _memory(r["max_memory_allocated"])),
        ("process wall time", lambda r: f"{r['wall_s']:.0f} s"),
    ]
    names = list(results)
    width = max(len(n) for n in names) + 2
    out = [f"{'':40}" + "".join(f"{n:>{max(width, 22)}}" for n in names)]
    for label, cell in rows:
        out.append(f"{label:40}" + "".join(f"{cell(results[n]):>{max(width, 22)}}" for n in names))
    return "\n".join(out)


def _early(r: dict) -> str:
    if r["early_tokens_per_s"] is None:
        return "-"
    share = r["early_tokens_per_s"] / r["tokens_per_s"]
    first, last = r["early_window"]
    return f"{r['early_tokens_per_s']:,.0f} ({share:.0%}, {first}-{last})"


def _share(r: dict) -> str:
    return f"{100 * r['data_wait_share']:.1f}%" if r["data_wait_share"] is not None else "-"


def _checkpoint(r: dict) -> str:
    if r["checkpoint_blocked_s"] is None:
        return "-"
    return f"{r['checkpoint_blocked_s']:.2f} / {r['checkpoint_s']:.2f} s"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _memory(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def warm_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The run that builds (or finds) the token cache once: one step of the smallest model, its
    positions as long as the measured runs' sequences (tiny's own 256 would refuse 1024)."""
    warm = command(args, out, ["--no-compile", "--max-position-embeddings", str(args.seq_length)])
    for flag, value in (("--max-steps", "1"), ("--preset", "tiny")):
        warm[warm.index(flag) + 1] = value
    return warm


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs = [r.strip() for r in args.runs.split(";") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="bench_run-") as tmp:
        launch(warm_command(args, Path(tmp) / "warm"), args.timeout)
        results = {}
        for name in runs:
            extra = [] if name == "defaults" else shlex.split(name)
            out = Path(tmp) / f"run{len(results)}"
            wall, stdout = launch(command(args, out, extra), args.timeout)
            records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
            results[name] = summarize(records, args.steps, wall)
            results[name]["banner"] = [
                line for line in stdout.splitlines() if line.startswith(("compile:", "attention:",
                                                                        "precision:", "optimizer:"))
            ]  # fmt: skip
    print(f"train.py --preset {args.preset} --seq-length {args.seq_length} --batch-size "
          f"{args.batch_size} --max-steps {args.steps} on {args.device}")  # fmt: skip
    print(table(results))
    for name, r in results.items():
        print(f"{name}: " + " | ".join(r["banner"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), "runs": results}, indent=1,
                                        default=str) + "\n")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
