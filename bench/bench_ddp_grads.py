"""DDP's gradients as views into its buckets: the host memory they save per rank (issue 58).

    python bench/bench_ddp_grads.py [--preset base] [--steps 4]

Two gloo processes (1 thread each) train the preset (vocabulary 8192) under DDP for ``--steps``
optimizer steps of two micro-batches (1 x 256 tokens, the first under no_sync), clearing the
gradients after each step as the trainer does (parallelize.zero_grad: in place, the gradients
stay views into the buckets) or as before (``zero_grad(set_to_none=True)``: each backward makes
fresh gradients beside the buckets, which the reducer copies in). From the second step on (the
first makes the buckets and, in both, fresh gradients), per rank: the peak host memory (VmHWM,
reset after the first step) above the resident memory before the second step, and the bytes of
gradients outside every bucket after a no_sync backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 8192


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rank_memory(rank: int, port: int, name: str, way: str, steps: int, out: str) -> None:
    from llama_ddp.distributed import runtime as D
    from llama_ddp.distributed.parallelize import (
        Init,
        empty_model,
        gradient_sync,
        parallelize,
        runtime,
        zero_grad,
    )
    from llama_ddp.model.config import preset
    from llama_ddp.precision import Precision
    from llama_ddp.train.optim import build_optimizer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    rt = runtime("ddp", "cpu")
    model = empty_model(preset(name, vocab_size=VOCAB))
    train_model = parallelize(model, rt, Precision(torch.float32, rt.device), Init(model, 0))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    buckets: list[tuple[int, int]] = []  # this synced backward's
    seen: list[tuple[int, int]] = []  # the last synced backward's

    def recording(group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        start = bucket.buffer().data_ptr()
        buckets.append((start, start + bucket.buffer().nbytes))
        return allreduce_hook(group, bucket)

    train_model.register_comm_hook(None, recording)
    outside, resident = [], 0
    for step in range(steps):
        if step == 1:
            resident = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # the peak restarts here
        for micro in range(2):
            with gradient_sync(train_model, micro == 1):
                x = torch.randint(0, VOCAB, (1, 256))
                train_model(x).float().logsumexp(-1).mean().backward()
            if micro == 0 and step >= 2:  # the buckets were rebuilt after the first step
                grads = [p.grad for p in model.parameters()]
                outside.append(
                    sum(g.nbytes for g in grads if not any(a <= g.data_ptr() < b for a, b in seen))
                )
            if micro == 1:
                seen, buckets = buckets, []
        optimizer.step()
        if way == "ours":
            zero_grad(train_model, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)
    result = {
        "peak_above_resident": _status("VmHWM") - resident,
        "resident": resident,
        "grads_outside_buckets": outside,
        "gradients": sum(p.nbytes for p in model.parameters()),
    }
    Path(out, f"{way}-rank{rank}.json").write_text(json.dumps(result))
    D.teardown(rt)


def measure(name: str, way: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.start_processes(
            rank_memory, args=(port, name, way, steps, tmp), nprocs=2, start_method="spawn"
        )
        return [json.loads(Path(tmp, f"{way}-rank{r}.json").read_text()) for r in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both ways")
    args = p.parse_args(argv)
    for round_ in range(args.rounds):
        for way in ("before", "ours"):
            for r, row in enumerate(measure(args.preset, way, args.steps)):
                mib = {k: v / 2**20 for k, v in row.items() if isinstance(v, int)}
                outside = ", ".join(f"{b / 2**20:,.0f}" for b in row["grads_outside_buckets"])
                print(
                    f"round {round_ + 1}, {way:6}, rank {r}: peak of steps 2-{args.steps} "
                    f"{mib['peak_above_resident']:,.0f} MiB above {mib['resident']:,.0f} MiB "
                    f"resident; gradients {mib['gradients']:,.0f} MiB, outside the buckets after "
                    f"each no_sync backward from step 3: {outside} MiB",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
