"""Training modes side by side on this machine: DDP x2 against FSDP x2 under torchrun, and the
step-time cost of activation checkpointing in one process.

    python bench/bench_modes.py                        # small preset, seq 256, batch 32, CPU
    python bench/bench_modes.py --rounds 3 --steps 12 --json bench/results/modes-cpu.json

Each round runs ``train.py`` once per variant, in a rotating order, for ``--steps`` optimizer
steps on the warm token cache, and reads tokens/s from its metrics.jsonl (every step logged; the
first two steps, warm-up, left out). A variant's figure is the median over its rounds of the
per-round median; a ratio is the median of the per-round ratios, so a slow spell on a shared
machine moves both sides of a pair alike. Under torchrun each process gets
``cpu_count / processes`` threads, as on a machine with one process per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def variants(nproc: int) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, extra train.py flags)."""
    return {
        f"ddp x{nproc}": (nproc, ["--mode", "ddp"]),
        f"fsdp x{nproc}": (nproc, ["--mode", "fsdp"]),
        "single": (1, []),
        "single + activation checkpointing": (1, ["--activation-checkpointing"]),
    }


def pairs(nproc: int) -> list[tuple[str, str]]:
    return [(f"fsdp x{nproc}", f"ddp x{nproc}"), ("single + activation checkpointing", "single")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dataset", default="sample")
    p.add_argument("--tokenizer", default=None, help="default: tokenizer/tokenizer.json")
    p.add_argument("--nproc", type=int, default=2, help="processes of the DDP and FSDP runs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--variants", default=None, help="comma-separated (default: all)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def run_variant(name: str, args: argparse.Namespace, out: Path) -> tuple[list[float], float]:
    """tokens/s of each logged step after the first two, and the peak GPU memory (bytes; 0 on
    the CPU)."""
    nproc, extra = variants(args.nproc)[name]
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [
        str(ROOT / "train.py"), "--preset", args.preset, "--dataset", args.dataset,
        "--tokenizer", args.tokenizer, "--seq-length", str(args.seq_length),
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--log-every", "1",
        "--eval-every", "0", "--eval-tokens", "4096", "--optimizer", "adamw", "--no-export-hf",
        "--out-dir", str(out),
        "--peak-tflops", "1", "--device", args.device, "--dtype", args.dtype, *extra,
    ]  # fmt: skip
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {name} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > 2]
    memory = max(r.get("max_memory_allocated", 0) for r in steps)
    return [r["tokens_per_s"] for r in steps], memory


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer is None:
        args.tokenizer = str(ROOT / "tokenizer" / "tokenizer.json")
    names = list(variants(args.nproc))
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
    rounds: dict[str, list[float]] = {n: [] for n in names}
    memory: dict[str, float] = dict.fromkeys(names, 0.0)
    with tempfile.TemporaryDirectory(prefix="bench_modes-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                out = Path(tmp) / f"{name.replace(' ', '_')}-{r}"
                tokens_per_s, peak = run_variant(name, args, out)
                rounds[name].append(statistics.median(tokens_per_s))
                memory[name] = max(memory[name], peak)
                print(f"round {r + 1}: {name:36} {rounds[name][-1]:9,.0f} tokens/s", flush=True)
    rows = {
        n: {"tokens_per_s": statistics.median(v), "rounds": v, "max_memory_allocated": memory[n]}
        for n, v in rounds.items()
    }
    ratios = {
        f"{a} / {b}": statistics.median(x / y for x, y in zip(rounds[a], rounds[b]))
        for a, b in pairs(args.nproc)
        if a in rounds and b in rounds
    }
    print(
        f"{args.preset} preset, seq {args.seq_length}, batch {args.batch_size}, "
        f"{args.steps} steps x {args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    for name, row in rows.items():
        mem = row["max_memory_allocated"]
        gib = f", max memory allocated {mem / 2**30:.2f} GiB per GPU" if mem else ""
        print(f"{name:36} {row['tokens_per_s']:9,.0f} tokens/s (median of round medians){gib}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "date": datetime.date.today().isoformat(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rows": rows,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
