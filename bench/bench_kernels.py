"""The attention backends for packed documents, each timed and checked on this GPU (issue 45).

    python bench/bench_kernels.py --json bench/results/kernels-cuda.json

Every fast backend this device runs (attention_plan/backends.py: flash-varlen, cudnn, and fa3 and
fa4 where their packages are installed), at two shapes: the base preset (12 query heads, 3
key/value heads, head dim 64) at 64 x 1024, and a 1B-class model (32 heads, 8 key/value heads,
head dim 64) at 8 x 2048. For each: forward + backward of one layer's attention, each row one
document, median of --repeats on the device's clock (kernel_choice.timing), the TFLOP/s that
makes (causal: half the square), and its largest error against float64 attention with the
tolerance the run's check applies (kernel_choice.errors). Then what `--attention auto` takes at
each shape. Backends take turns round after round; a figure is its median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_ddp.attention_plan import backends  # noqa: E402
from llama_ddp.model import kernel_choice  # noqa: E402
from llama_ddp.model.kernel_choice import Shape  # noqa: E402

SHAPES = {
    "base 64x1024": Shape(torch.bfloat16, 12, 3, 64, 64, 1024),
    "1B 8x2048": Shape(torch.bfloat16, 32, 8, 64, 8, 2048),
}


def tflops(shape: Shape, seconds: float) -> float:
    """Forward (2 matmuls) + backward (5): 7 x 2 x T^2/2 x D per head and row (causal)."""
    flops = 7 * shape.rows * shape.heads * shape.seq_length**2 * shape.head_dim
    return flops / seconds / 1e12


def first_and_again(backend, device: torch.device, shape: Shape, count: int = 3) -> dict:
    """Milliseconds of forward + backward on a layout met for the first time and on the same
    layout again (medians over ``count`` new layouts): what a kernel builds per grid shape
    (cuDNN's graphs) is the difference."""
    plans = kernel_choice.layouts(shape.rows, shape.seq_length, count + 7)[7:]
    n, d = shape.rows * shape.seq_length, shape.head_dim
    heads = (shape.heads, shape.kv_heads, shape.kv_heads)
    qkv = [torch.randn(n, h, d, device=device, dtype=shape.dtype, requires_grad=True)
           for h in heads]  # fmt: skip
    grad = torch.randn(n, shape.heads, d, device=device, dtype=shape.dtype)
    first, again = [], []
    for plan in plans:
        fn = kernel_choice._kernel(plan.to(device), backend)
        for seconds in (first, again):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.autograd.grad(fn(*qkv), qkv, grad)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"first_ms": ms(first), "again_ms": ms(again)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results: dict[str, dict] = {"device": torch.cuda.get_device_name(device)}
    results["torch"] = torch.__version__
    for label, shape in SHAPES.items():
        found, why = backends.candidates(device, shape.dtype, shape.head_dim)
        rows: dict[str, dict] = {name: {"left out": reason} for name, reason in why.items()}
        times: dict[str, list[float]] = {b.name: [] for b in found}
        for backend in found:
            try:  # (errors activates the backend, after its references ran on torch's own)
                errors = kernel_choice.errors(backend, device, shape)
            except Exception as exc:
                rows[backend.name] = {"failed": f"{type(exc).__name__}: {exc}"[:200]}
                times.pop(backend.name)
                continue
            rows[backend.name] = {k: [round(e, 5), round(t, 5)] for k, (e, t) in errors.items()}
        for r in range(args.rounds):
            for backend in found[r % len(found) :] + found[: r % len(found)]:
                if backend.name in times:
                    backends.activate(backend)
                    times[backend.name].append(kernel_choice.timing(backend, device, shape))
        for name, measured in times.items():
            ms = statistics.median(measured) * 1e3
            rows[name] |= {"ms": round(ms, 3), "tflops": round(tflops(shape, ms / 1e3), 1)}
        for backend in found:
            if backend.name in times:
                backends.activate(backend)
                rows[backend.name] |= first_and_again(backend, device, shape)
        start = time.perf_counter()
        choice = kernel_choice.choose(device, shape)
        took = time.perf_counter() - start
        rows["auto"] = {"takes": choice.backend.name, "line": choice.line, "choice_s": took}
        results[label] = rows
        print(label, json.dumps(rows, indent=1), flush=True)
    backends.activate(backends.BACKENDS["flash-varlen"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
