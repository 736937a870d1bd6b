"""Training throughput and MFU: llama_ddp against transformers and the article's plain model.

    python bench/bench_train.py                                  # CPU, small preset, seq 256
    python bench/bench_train.py --contenders ours,ours+compile,ours+fused --json out.json
    python bench/bench_train.py --device cuda --preset base --seq-length 512 --dtype bf16 --compile

Contenders (bench/contenders.py), all on the same batches of the cached corpus and from the
same initial weights: ours[+OPTION...], transformers[+fp32|+bf16], article; by default in pack
mode ours (documents kept apart), ours+causal (plain causal windows), transformers and article.
A step is one optimizer step *including* drawing its batch (the run's MixtureSampler +
make_loader).
After warm-up steps (the first is timed as the time to first step; the first contender's also
pays the process's one-time costs) the contenders take turns, round after round, the order
rotating, N steps each. tokens/s is a contender's median round; a ratio is the median of the
per-round ratios, so a slow spell on a shared machine moves both sides of a pair alike. MFU is
the contender's model FLOPs per token (as train.py counts them: attention per document when it
keeps documents apart, else per row) x tokens/s over the peak: on CPU the best matmul FLOP/s
reading (1024 and 2048, measured before the contenders and again after them), on CUDA the table
for --dtype. Finally
``python train.py --max-steps 1`` runs on the warm cache and its time to the first optimizer step
is read from its output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import (  # noqa: E402
    Contender,
    make_article,
    make_ours,
    make_transformers,
    profile_step,
    resident_bytes,
    sync,
    train_config,
)

from llama_ddp.data.corpus import default_cache_dir, load_splits  # noqa: E402
from llama_ddp.model.llama import flops_per_token  # noqa: E402
from llama_ddp.precision import resolve_dtype  # noqa: E402
from llama_ddp.train.speed import gpu_peak_flops, measure_matmul_flops, mfu  # noqa: E402
from llama_ddp.train.trainer import Trainer  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default: the preset's"
    )
    p.add_argument("--packing", choices=("pack", "pad"), default="pack")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, sequences")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the batch")
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per round")
    p.add_argument("--rounds", type=int, default=7, help="short rounds pair up better")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps (the first: TTFS; the last: profiled)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="ours and transformers"
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile llama_ddp's model (default: train.py's auto, on for CUDA)",
    )
    p.add_argument(
        "--contenders",
        default=None,
        help="comma-separated; default: ours,ours+causal,transformers,article in pack mode, "
        "ours,transformers,article in pad mode",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time, not wall time, so a shared machine's other work does "
        "not count (CPU only, with --threads 1: idle threads spin)",
    )
    p.add_argument(
        "--dataset",
        default="sample",
        help="as train.py's, or sample-paragraphs: the sample corpus cut at blank lines (short "
        "documents, for --packing pad)",
    )
    p.add_argument("--tokenizer", default=None, help="default: tokenizer/tokenizer.json if any")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: llama_ddp's cache")
    p.add_argument("--peak-tflops", type=float, default=None, help="instead of measuring")
    p.add_argument("--profile", type=int, default=0, help="print each contender's top N ops")
    p.add_argument("--no-train-py", action="store_true", help="skip the train.py first-step run")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def timed_round(c: Contender, steps: int, device: torch.device, clock=time.perf_counter) -> None:
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    data_before, tokens_before = c.data_s, c.tokens
    sync(device)
    start = clock()
    for _ in range(steps):
        loss = c.step()
        sync(device)
    seconds = clock() - start
    c.last_loss = float(loss)
    c.rounds.append(
        {
            "seconds": seconds,
            "tokens_per_s": (c.tokens - tokens_before) / seconds,  # real targets, as train.py
            "data_fraction": (c.data_s - data_before) / seconds,
        }
    )
    if device.type == "cuda":  # this contender's own peak: others' weights are resident too
        peak = torch.cuda.max_memory_allocated(device) - base + resident_bytes(c)
        c.peak_bytes = max(c.peak_bytes, peak)


def matmul_readings(dtype: torch.dtype, readings: dict | None = None) -> dict[int, list[float]]:
    """One CPU matmul FLOP/s reading per size (each the best of a few short trials), added to
    ``readings``. Load from other processes only ever lowers a reading, so the best is the peak."""
    readings = readings or {1024: [], 2048: []}
    for size, values in readings.items():
        values.append(measure_matmul_flops(dtype, size))
    return readings


def peak_flops(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, readings: dict
) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "given"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest"  # fp32 on TF32 tensor cores
        return gpu_peak_flops(name, dtype, tf32), f"table ({name}, {dtype}, tf32={tf32})"
    size = max(readings, key=lambda s: max(readings[s]))
    count = sum(len(v) for v in readings.values())
    source = f"measured: best of {count} {dtype} matmul readings (before, after) at {size}"
    return max(readings[size]), source


def train_py_first_step(args: argparse.Namespace, tokenizer: Path, out_dir: Path) -> dict:
    """Run ``python train.py --max-steps 1`` on the warm cache; seconds to its step-1 log line."""
    cmd = [
        sys.executable, str(ROOT / "train.py"), "--preset", args.preset, "--dataset", args.dataset,
        "--tokenizer", str(tokenizer), "--seq-length", str(args.seq_length),
        "--packing", args.packing,
        "--batch-size", str(args.batch_size), "--max-steps", "1", "--log-every", "1",
        "--eval-tokens", "4096", "--no-export-hf", "--resume", "none", "--out-dir", str(out_dir),
        "--cache-dir", str(args.cache_dir), "--device", args.device, "--dtype", args.dtype,
    ]  # fmt: skip
    if args.micro_batch_size:
        cmd += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.max_position_embeddings:
        cmd += ["--max-position-embeddings", str(args.max_position_embeddings)]
    if args.compile is not None:
        cmd.append("--compile" if args.compile else "--no-compile")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if first is None and line.startswith("step 1:"):
            first = time.perf_counter() - start
    code = proc.wait()
    if code != 0 or first is None:
        tail = "\n".join(lines[-5:])
        raise SystemExit(f"error: train.py exited {code} without a step-1 line:\n{tail}")
    return {"first_step_s": first, "exit_s": time.perf_counter() - start, "command": cmd}


def build(args: argparse.Namespace, tmp: Path) -> tuple[list[Contender], Trainer]:
    """The contenders named by --contenders, and the Trainer of plain ``ours``, which holds the
    data, the initial weights and the schedule every contender shares."""
    ours_cfg = train_config(args, args.tokenizer, tmp / "ours")
    ours, trainer = make_ours("ours", ours_cfg)
    pad_id = trainer.data.special.ids.pad
    contenders = []
    for name in (n.strip() for n in args.contenders.split(",") if n.strip()):
        if name == "ours":
            contenders.append(ours)
        elif name.startswith("ours+"):
            cfg = train_config(args, str(trainer.data.tokenizer_path), tmp / name)
            contenders.append(make_ours(name, cfg)[0])
        elif name.split("+")[0] == "transformers":
            contenders.append(make_transformers(name, trainer, ours_cfg))
        elif name == "article":
            contenders.append(make_article(trainer, ours_cfg, pad_id))
        else:
            raise SystemExit(
                f"error: unknown contender {name!r} (ours[+option...], transformers, article)"
            )
    compiled = [
        c.name for c in contenders if c.name.startswith("ours") and "compiled" in c.settings
    ]
    if len(compiled) > 1:
        # Dynamo caches a graph per code object, not per model: the second compiled model would
        # run the first one's graph, SDPA kernel choice included (it is not part of the guards).
        raise SystemExit(
            f"error: {', '.join(compiled)} are compiled in one process and would share one graph "
            "(run them in separate invocations, as bench/bench_gpu.sh does)"
        )
    return contenders, trainer


def measure(contenders: list[Contender], args: argparse.Namespace, device: torch.device) -> None:
    """Warm-up steps per contender (the first timed as the time to first step, the last
    profiled), then the timed rounds, each contender's turn in a rotating order."""
    for c in contenders:
        for i in range(args.warmup):
            sync(device)
            start = time.perf_counter()
            if i == args.warmup - 1 and i > 0:
                loss = profile_step(c, device, args.profile)
            else:
                loss = c.step()
            sync(device)
            if i == 0:
                c.first_step_s = time.perf_counter() - start
                c.first_loss = float(loss)
    for r in range(args.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            timed_round(c, args.steps, device, CLOCKS[args.clock])
    for c in contenders:
        if args.warmup < 2:
            profile_step(c, device, args.profile)


def prepare(args: argparse.Namespace) -> torch.device:
    """Threads, cache and tokenizer defaults."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.contenders is None:
        causal = "ours+causal," if args.packing == "pack" else ""
        args.contenders = f"ours,{causal}transformers,article"
    args.cache_dir = args.cache_dir or default_cache_dir()
    if args.tokenizer is None:
        default = ROOT / "tokenizer" / "tokenizer.json"
        args.tokenizer = str(default) if default.is_file() else "auto"  # auto: trained and cached
    if args.dataset == "sample-paragraphs":
        args.dataset = str(sample_paragraphs(args.cache_dir))
    return torch.device(args.device)


def sample_paragraphs(cache_dir: Path) -> Path:
    """Short documents for --packing pad: the sample corpus's training files joined into one
    .txt, which llama_ddp (and so every contender) reads as paragraphs at blank lines."""
    path = cache_dir / "bench" / "sample-paragraphs.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(load_splits("sample", cache_dir=cache_dir).train)
        path.with_suffix(".tmp").write_text(text, encoding="utf-8")
        path.with_suffix(".tmp").replace(path)
    return path


def run(args: argparse.Namespace) -> dict:
    """Measure the CPU peak, build the contenders, time them round by round, measure the peak
    again, and return the results."""
    device = prepare(args)
    dtype = resolve_dtype(args.dtype, device)
    cpu_peak = device.type == "cpu" and not args.peak_tflops
    readings = matmul_readings(dtype) if cpu_peak else {}
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        contenders, trainer = build(args, Path(tmp))
        measure(contenders, args, device)
        if cpu_peak:
            matmul_readings(dtype, readings)
        first = None
        if not args.no_train_py:
            first = train_py_first_step(args, trainer.data.tokenizer_path, Path(tmp) / "train_py")
    peak, source = peak_flops(args, device, dtype, readings)
    return summarize(args, contenders, trainer, device, peak, source, first)


def summarize(args, contenders, trainer, device, peak, peak_source, first) -> dict:
    fpt = flops_per_token(trainer.model.config, args.seq_length)
    rows = {}
    for c in contenders:
        tps = statistics.median(r["tokens_per_s"] for r in c.rounds)
        rows[c.name] = {
            "settings": c.settings,
            "tokens_per_s": tps,
            "tokens": c.tokens,  # real targets of every step it took (the same batches for all)
            "flops": c.flops,  # their model FLOPs
            "flops_per_token": c.flops / c.tokens,
            "mfu": mfu(c.flops / c.tokens, tps, peak) if peak else None,
            "rounds": c.rounds,
            "data_fraction": statistics.median(r["data_fraction"] for r in c.rounds),
            "setup_s": c.setup_s,
            "first_step_s": c.first_step_s,
            "first_step_loss": c.first_loss,
            "last_step_loss": c.last_loss,
            "attention_kernels": c.kernels,
            "max_memory_allocated": c.peak_bytes if device.type == "cuda" else None,
        }
    # Paired by round (the rounds alternate the contenders), then the median: a slow spell
    # that lasts a round or two moves both sides of a pair alike.
    base = contenders[0]
    ratios = {
        f"{base.name}/{c.name}": statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(base.rounds, c.rounds)
        )
        for c in contenders[1:]
    }
    return {
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_config": trainer.model.config.to_dict(),
        "parameters": trainer.model.num_parameters(),
        "positions_per_step": args.batch_size * args.seq_length,
        "flops_per_token": fpt,  # of a full causal row; each contender's own is in its row
        "peak_flops": peak,
        "peak_source": peak_source,
        "contenders": rows,
        "ratios": ratios,
        "train_py": first,
        "profiles": {c.name: c.profile for c in contenders if c.profile},
    }


def report(result: dict) -> None:
    a = result["args"]
    peak = result["peak_flops"]
    print(
        f"{a['preset']} preset ({result['parameters'] / 1e6:.1f}M parameters), "
        f"seq {a['seq_length']} ({a['packing']}), "
        f"batch {a['batch_size']} = {result['positions_per_step']} positions/step, "
        f"{result['machine']['device']} x{result['machine']['torch_threads']} threads | "
        f"peak {peak / 1e12 if peak else float('nan'):.3f} TFLOP/s {result['peak_source']} | "
        f"median of {a['rounds']} rounds x {a['steps']} steps"
    )
    base = next(iter(result["contenders"]))
    cuda = a["device"] == "cuda"
    head = f"{'contender':20} {'tokens/s':>9} {'MFU':>6} {base + '/x':>8} {'setup s':>8} "
    head += f"{'1st step s':>10} {'data %':>7} {'loss 1st':>8} {'loss last':>9}"
    print(head + (f" {'max mem GiB':>11}" if cuda else ""))
    for name, r in result["contenders"].items():
        ratio = result["ratios"].get(f"{base}/{name}", 1.0)
        line = (
            f"{name:20} {r['tokens_per_s']:9,.0f} {100 * (r['mfu'] or 0):5.1f}% {ratio:7.2f}x "
            f"{r['setup_s']:8.2f} {r['first_step_s']:10.2f} {100 * r['data_fraction']:6.2f}% "
            f"{r['first_step_loss']:8.4f} {r['last_step_loss']:9.4f}"
        )
        if cuda:
            line += f" {r['max_memory_allocated'] / 2**30:11.2f}"
        print(line)
    for name, r in result["contenders"].items():
        print(
            f"  {name}: {r['settings']}; {r['flops_per_token'] / 1e6:.2f} MFLOP/token; "
            f"attention: {', '.join(r['attention_kernels'])}"
        )
    print(
        "ratios (median of per-round ratios): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items())
    )
    if result["train_py"]:
        t = result["train_py"]
        print(
            f"python train.py --max-steps 1 (warm cache): first optimizer step at "
            f"{t['first_step_s']:.2f}s, exit at {t['exit_s']:.2f}s"
        )
    for name, table in result["profiles"].items():
        print(f"--- {name}: top ops of one step\n{table}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
