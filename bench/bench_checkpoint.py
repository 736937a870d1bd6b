"""How long a checkpoint takes to save (and to load), per preset: what a preempted run needs of
the grace period between SIGTERM and SIGKILL (README, Preemption).

    python bench/bench_checkpoint.py                         # tiny, small, base; in /tmp
    python bench/bench_checkpoint.py --dir /mnt/shared/x     # on the disk your runs write to
    python bench/bench_checkpoint.py --json bench/results/checkpoint-cpu.json

Each preset's model and AdamW state (fp32: 12 bytes per parameter, plus the RNG, schedule and
train-state parts) are built with the trainer's own builders and saved through its Checkpointer,
a single process writing as rank 0 does under DDP, ``--rounds`` times in interleaved rounds (each
round saves every preset once; the fastest and the median per preset are reported, since a noisy
disk or CPU steal only ever slows a save down). Each save is timed twice: written in the step
(``save``: what training waited before checkpoints were written in the background) and as
train.py saves, in the background (the median seconds ``save`` kept training waiting while it
staged the state, and those until the folder was complete). The 1.1B shape (TinyLlama's) is
computed from the bytes per second the largest measured preset achieved: a machine's disk decides
it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_memory import ONE_B  # TinyLlama-1.1B's shape

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_ddp.checkpoint import state as ckpt  # noqa: E402
from llama_ddp.checkpoint.manager import Checkpointer  # noqa: E402
from llama_ddp.distributed import runtime as D  # noqa: E402
from llama_ddp.distributed.parallelize import build_model  # noqa: E402
from llama_ddp.model.config import LlamaConfig, preset  # noqa: E402
from llama_ddp.model.llama import LlamaForPretraining  # noqa: E402
from llama_ddp.train.optim import ScheduleState, build_optimizer, make_schedule  # noqa: E402
from llama_ddp.train.trainer import TrainState  # noqa: E402

VOCAB = 8192


def checkpointer(name: str, out: Path, background: bool) -> tuple[Checkpointer, int]:
    """A Checkpointer over the parts a run of preset ``name`` saves; its parameter count."""
    cpu = torch.device("cpu")
    model = build_model(preset(name, vocab_size=VOCAB), 0, cpu)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    for p in model.parameters():  # the AdamW moments exist after the first step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule = make_schedule("cosine", lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=100)
    parts = {
        "settings": ckpt.Settings({"model_shape": model.config.to_dict()}),
        "model": ckpt.ModelState(model),
        "optimizer": ckpt.OptimizerState(model, optimizer),
        "train": TrainState(),
        "schedule": ScheduleState(schedule),
        "rng": ckpt.RNGState(),
    }
    rt = D.Runtime("single", cpu)
    saver = Checkpointer(
        out, parts, rt, every=0, keep_last=1, collective=False, background=background
    )
    return saver, model.num_parameters()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small,base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: /tmp)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        names = [n.strip() for n in args.presets.split(",") if n.strip()]
        savers = {n: checkpointer(n, root / n, background=False) for n in names}
        background = {n: checkpointer(n, root / f"{n}-bg", background=True)[0] for n in names}
        kinds = ("save", "load", "blocked", "complete")
        times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in names}
        sizes = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up (first DCP import, page cache)
            for name in names:
                saver, _ = savers[name]
                step = round_ + 1
                seconds = saver.save(step)
                start = time.perf_counter()
                saver.load(saver.folder(step))
                loaded = time.perf_counter() - start
                sizes[name] = folder_bytes(saver.folder(step))
                start = time.perf_counter()
                blocked = background[name].save(step)  # training would go on from here
                background[name].wait()
                complete = time.perf_counter() - start
                if round_ > 0:
                    for kind, value in zip(kinds, (seconds, loaded, blocked, complete)):
                        times[name][kind].append(value)
        results = {}
        print(f"{'preset':>8} {'params':>9} {'checkpoint':>11} {'save s (min / median)':>22} "
              f"{'load s (min / median)':>22} "
              f"{'background: blocked / complete s':>34}")  # fmt: skip
        for name in names:
            t, params = times[name], savers[name][1]
            results[name] = {
                "parameters": params,
                "bytes": sizes[name],
                "save_s": t["save"],
                "load_s": t["load"],
                "background_blocked_s": t["blocked"],
                "background_complete_s": t["complete"],
            }
            blocked, complete = statistics.median(t["blocked"]), statistics.median(t["complete"])
            print(
                f"{name:>8} {params / 1e6:>8.1f}M {sizes[name] / 2**20:>9.0f}MB "
                f"{min(t['save']):>10.2f} / {statistics.median(t['save']):<10.2f} "
                f"{min(t['load']):>10.2f} / {statistics.median(t['load']):<10.2f} "
                f"{blocked:>16.2f} / {complete:<16.2f}"
            )
        largest = max(names, key=lambda n: sizes[n])
        rate = sizes[largest] / min(times[largest]["save"])
        with torch.device("meta"):  # its shape only: no memory
            params_1b = LlamaForPretraining(LlamaConfig(**ONE_B)).num_parameters()
        bytes_1b = 12 * params_1b  # fp32 weights + AdamW's two moments
        results["1.1B (computed)"] = {
            "parameters": params_1b,
            "bytes": bytes_1b,
            "save_s": [bytes_1b / rate],
            "from": f"{largest}'s {rate / 2**20:.0f} MB/s",
        }
        print(
            f"{'1.1B':>8} {params_1b / 1e6:>8.1f}M {bytes_1b / 2**20:>9.0f}MB "
            f"{bytes_1b / rate:>10.1f} (computed at {largest}'s {rate / 2**20:.0f} MB/s)"
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
