"""The lm_head and loss of a training step, whole logits against chunks (model/loss.py): the peak
memory each adds to the step and its time, forward and backward, side by side in one run.

    python bench/bench_loss.py --json bench/results/loss-cpu.json
    python bench/bench_loss.py --device cuda --json bench/results/loss-cuda.json
    python bench/bench_loss.py --tokens 4096 --shapes 64x4096,64x8192,768x8192 \
        --contenders before,chunked --dtypes fp32,bf16 --no-peaks --rounds 5

The shape is the `base` preset's width (hidden 768) and vocab 8192 on 8 x 1024 tokens (a tenth
of them PAD targets), the final norm's fp32 output as the input, in fp32 and (CUDA) under bf16
autocast:
- ``whole``: today's evaluation path, ``token_loss_sum(lm_head(hidden), labels)``: the (tokens x
  vocab) logits, their fp32 copy and their gradient whole;
- ``chunked``: training's, ``linear_token_loss_sum``: a chunk of tokens' logits at a time
  (`chunk_tokens`' rule for the device: on the CPU 8 MiB of fp32 logits a chunk);
- ``before``: the same before issue 59, kept here alone: the GPU's chunks on every device (at
  least 4096 tokens each) and each chunk's softmax as it was (`before_chunk_loss`: logsumexp's
  copy, then the softmax again in place, the mask and the cast: each a pass over the logits);
- ``compiled``: the same with each chunk's softmax, loss and gradient through torch.compile
  (inductor: one fused kernel), as a run that compiles (CUDA's default, --compile) trains;
- ``liger``: the chunks of Liger-Kernel's rule alone (ceil(vocab / hidden) chunks, whatever the
  tokens; training's before issue 53): each chunk writes the whole weight gradient, so at a
  large vocabulary (``--vocab 131072``) its memory traffic grows with vocab^2.
``--shapes`` runs the contenders at each (hidden x vocab) in turn, ``--dtypes fp32,bf16`` in
both. Peak memory (``--no-peaks``: not measured): on the CPU each contender runs one step in a
process of its own and reports the rise of its resident set's high-water mark over the inputs
(/proc's VmHWM, reset after they are made); on CUDA, max_memory_allocated over what is
allocated before the step. Time: one untimed step each, then the contenders take turns for
``--rounds`` rounds; the fastest and the median (and beside ``before``, the median of the
rounds' ratios). On the CPU, whose matrix products take nearly all of the time, also the time
outside them (the softmax, loss, gradient and casts: what compiling fuses), from a profiled
step of each in every round, the fastest (``--no-outside``: not profiled); on CUDA the step's
time shows it. On the CPU also each step's CPU time (its fastest): with ``--threads 1`` the
work itself, which a machine shared with other processes stretches less than the wall time
(with two threads a step waits at every op's barrier for a thread another process holds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import cpu_name  # noqa: E402

from llama_ddp.model import loss as loss_module  # noqa: E402
from llama_ddp.model.loss import IGNORE_INDEX, linear_token_loss_sum, token_loss_sum  # noqa: E402

CONTENDERS = ("whole", "before", "chunked", "compiled", "liger")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(device)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    labels[torch.rand(args.tokens, generator=gen) < 0.1] = IGNORE_INDEX
    return hidden, weight.requires_grad_(), labels.to(device)


def before_chunk_loss(h, weight, labels, grads):
    """`loss.chunk_loss` before issue 59: logsumexp (its own max, a shifted copy, its exp and
    sum), then the shift and the exp again in place, the ignored rows masked, the cast: the
    gradient's ignored rows zero (the loop's masking of the (n, C) rows changes nothing)."""
    logits = (h @ weight.T).float()
    real = (labels != IGNORE_INDEX).unsqueeze(1)
    target = labels.clamp(min=0).unsqueeze(1)
    lse = logits.logsumexp(-1, keepdim=True)
    total = torch.where(real, lse - logits.gather(1, target), 0.0).sum()
    if not grads:
        return total, None
    g = logits.sub_(lse).exp_().masked_fill_(~real, 0.0).to(h.dtype)
    return total, g.scatter_add_(1, target, real.to(g.dtype).neg())


def before(hidden, weight, labels) -> torch.Tensor:
    """`linear_token_loss_sum` before issue 59: the GPU's chunk rule everywhere (the 4096-token
    floor), `before_chunk_loss` for each chunk."""
    device = hidden.device.type
    on = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if on else torch.float32
    chunk = loss_module.chunk_tokens(*hidden.shape, weight.shape[0], "cuda")
    args = hidden.to(dtype), weight.to(dtype), labels, chunk, True, before_chunk_loss
    return loss_module._LinearCrossEntropy.apply(*args)


def step(name: str, dtype: torch.dtype, hidden, weight, labels) -> None:
    """One forward and backward of the lm_head and the loss (mean over the real targets)."""
    on = dtype != torch.float32
    with torch.autocast(hidden.device.type, dtype=dtype, enabled=on):
        if name == "whole":
            loss = token_loss_sum(F.linear(hidden, weight), labels)
        elif name == "before":
            loss = before(hidden, weight, labels)
        elif name == "liger":
            rows = -(-len(labels) // -(-weight.shape[0] // weight.shape[1]))
            loss = linear_token_loss_sum(hidden, weight, labels, max(64, -(-rows // 64) * 64))
        else:
            backend = "inductor" if name == "compiled" else None
            loss = linear_token_loss_sum(hidden, weight, labels, backend=backend)
    (loss / (labels != IGNORE_INDEX).sum()).backward()
    hidden.grad = weight.grad = None


PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_")


def outside_products(name: str, dtype: torch.dtype, tensors: tuple) -> float:
    """Seconds of one CPU step's ops other than the matrix products (their own time)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(name, dtype, *tensors)
    events = prof.key_averages()
    return sum(e.self_cpu_time_total for e in events if e.key not in PRODUCTS) / 1e6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(args, name: str, dtype: str, device: torch.device) -> int:
    """The step's peak memory over its inputs' (see the module docstring)."""
    if device.type == "cuda":
        tensors = inputs(args, device)
        step(name, DTYPES[dtype], *tensors)  # compiled: its compile's memory is not the step's
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(name, DTYPES[dtype], *tensors)
        return torch.cuda.max_memory_allocated(device) - before
    argv = [sys.executable, __file__, "--peak-of", f"{name},{dtype}"]
    argv += ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_peak(args) -> int:
    """In a process of its own: the rise of the resident high-water mark over the inputs'."""
    name, dtype = args.peak_of.split(",")
    tensors = inputs(args, torch.device("cpu"))
    step(name, DTYPES[dtype], *tensors)  # compiled: its compile's memory is not the step's
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    before = status_kib("VmHWM")
    step(name, DTYPES[dtype], *tensors)
    print((status_kib("VmHWM") - before) * 1024)
    return 0


def measure(args, device: torch.device, runs: list[tuple[str, str]]) -> tuple[dict, list[str]]:
    """Each contender at ``args``' shape: (figures by "name-dtype", the lines that say them)."""
    peaks = {run: peak_bytes(args, *run, device) if args.peaks else None for run in runs}
    tensors = inputs(args, device)
    for name, dtype in runs:  # the warm-up: kernels chosen, memory pooled
        step(name, DTYPES[dtype], *tensors)
    seconds: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    cpu: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for name, dtype in runs:
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            step(name, DTYPES[dtype], *tensors)
            sync(device)
            seconds[name, dtype].append(time.perf_counter() - start)
            cpu[name, dtype].append(time.process_time() - start_cpu)
    outside = {}
    if device.type == "cpu" and args.outside:
        for _ in range(args.rounds):  # interleaved too; the fastest
            for name, dtype in runs:
                seconds_out = outside_products(name, DTYPES[dtype], tensors)
                outside[name, dtype] = min(outside.get((name, dtype), seconds_out), seconds_out)
    figures, lines = {}, [f" hidden {args.hidden}, vocab {args.vocab}:"]
    for name, dtype in runs:
        times, peak = seconds[name, dtype], peaks[name, dtype]
        fastest, median = min(times), statistics.median(times)
        figures[f"{name}-{dtype}"] = {
            "peak_bytes": peak,
            "fastest_s": fastest,
            "median_s": median,
            "all_s": times,
            "cpu_s": cpu[name, dtype],
        }
        line = f"  {name:8s} {dtype}: "
        line += "" if peak is None else f"peak +{peak / 2**20:7.1f} MiB   "
        line += f"fastest {fastest * 1e3:8.1f} ms   median {median * 1e3:8.1f} ms"
        if device.type == "cpu":
            line += f"   CPU time fastest {min(cpu[name, dtype]) * 1e3:8.1f} ms"
        if (name, dtype) in outside:
            figures[f"{name}-{dtype}"]["outside_products_s"] = outside[name, dtype]
            line += f"   outside the products {outside[name, dtype] * 1e3:7.1f} ms"
        if name != "before" and f"before-{dtype}" in figures:
            ratios = [b / t for b, t in zip(seconds["before", dtype], times)]
            line += f"   before / this {statistics.median(ratios):.2f}x (median of the rounds)"
        lines.append(line)
    return figures, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8 * 1024)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument(
        "--shapes",
        default=None,
        help="HIDDENxVOCAB,...: each shape in turn (default: --hidden x --vocab)",
    )
    p.add_argument(
        "--dtypes",
        default=None,
        help="fp32, bf16 or both (default: both on CUDA; fp32 on the CPU, whose bf16 matmuls "
        "are emulated on a CPU without AVX512-BF16 or AMX: minutes at the base shape)",
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="which to run (default: all)")
    p.add_argument("--rounds", type=int, default=2, help="timed steps of each contender")
    p.add_argument(
        "--peaks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each contender's peak memory (on the CPU a process of its own each)",
    )
    p.add_argument(
        "--outside",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the CPU, the time outside the matrix products (a profiled step each round)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # the child's contender
    args = p.parse_args(argv)
    if args.peak_of:
        return child_peak(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = (args.dtypes or ("fp32,bf16" if device.type == "cuda" else "fp32")).split(",")
    names = args.contenders.split(",")
    if set(names) - set(CONTENDERS):
        p.error(f"--contenders: choose among {', '.join(CONTENDERS)}")
    try:
        shapes = [tuple(map(int, s.split("x"))) for s in (args.shapes or "").split(",") if s]
    except ValueError:
        p.error("--shapes: HIDDENxVOCAB,... (e.g. 64x8192,768x8192)")
    runs = [(name, dtype) for dtype in dtypes for name in names]
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"lm_head + loss of {args.tokens} tokens; {machine}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, ATEN_CPU_CAPABILITY "
        f"{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}; {args.rounds} interleaved rounds",
        flush=True,
    )
    results = []
    for hidden, vocab in shapes or [(args.hidden, args.vocab)]:
        shaped = argparse.Namespace(**{**vars(args), "hidden": hidden, "vocab": vocab})
        figures, lines = measure(shaped, device, runs)
        print("\n".join(lines), flush=True)
        shape = {"tokens": args.tokens, "hidden": hidden, "vocab": vocab}
        results.append({"shape": shape, "contenders": figures})
    if args.json:
        doc = {
            "machine": machine,
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "rounds": args.rounds,
            "runs": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
