"""Memory per rank: what activation checkpointing saves, and what FSDP shards.

    python bench/bench_memory.py                    # all three parts, CPU
    python bench/bench_memory.py --json bench/results/memory-cpu.json

1. Activation memory of one training step (forward + backward) on the CPU, with and without
   --activation-checkpointing, for the `small` and `base` presets at seq 1024, micro batch 4:
   each configuration runs in a fresh process that builds the model and AdamW through the
   trainer's builders, allocates the optimizer state, resets the kernel's peak-RSS counter
   (``echo 5 > /proc/self/clear_refs``), runs the step, and reads VmHWM - VmRSS before the step.
2. Bytes per rank of weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes per parameter),
   computed for the `base` preset and a 1.1B configuration (TinyLlama's shape) under DDP and
   FSDP at 2 and 8 ranks.
3. FSDP x2 measured (two gloo processes, 1 thread each): the bytes of each rank's local shards of
   weights, gradients and AdamW state after an optimizer step of two accumulated micro-batches
   (1 x 256 tokens each), and each rank's peak host memory (VmHWM) from start-up to after the
   step, for `small`, `base` and the TinyLlama shape with fewer layers (``1B-<L>L``: the same
   widths and vocabulary, L layers). Two ways of building: ``meta`` (the trainer's: the model on
   the meta device, sharded, then each rank materializes its shards; gradients reduce-scattered
   every micro-batch) and ``full`` (before issue 21: every rank builds the whole model, then
   shards it, and accumulates unsharded gradients until the last micro-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_ddp.distributed.parallelize import empty_model  # noqa: E402
from llama_ddp.model.config import LlamaConfig, preset  # noqa: E402
from llama_ddp.train.config import TrainConfig  # noqa: E402

VOCAB = 8192
ONE_B = dict(  # TinyLlama-1.1B's shape
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
BYTES = {"weights": 4, "gradients": 4, "AdamW state": 8}


def shape(name: str) -> LlamaConfig:
    """A preset, ``1.1B`` (TinyLlama's shape) or ``1B-<L>L`` (its widths, L layers)."""
    if name == "1.1B":
        return LlamaConfig(**ONE_B)
    if name.startswith("1B-"):
        return LlamaConfig(**{**ONE_B, "num_hidden_layers": int(name[3:-1])})
    return preset(name, vocab_size=VOCAB)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def step_memory(preset_name: str, seq: int, micro: int, checkpointing: bool) -> dict:
    """One step's peak memory above the resident model and optimizer state (this process)."""
    from llama_ddp.data.pipeline import Batch
    from llama_ddp.distributed import runtime as D
    from llama_ddp.distributed.parallelize import build_model, parallelize
    from llama_ddp.model.loss import batch_loss_sum
    from llama_ddp.precision import Precision
    from llama_ddp.train.optim import build_optimizer

    cpu = torch.device("cpu")
    cfg = TrainConfig.from_flags(
        preset=preset_name,
        seq_length=seq,
        max_position_embeddings=max(
            seq, preset(preset_name, vocab_size=VOCAB).max_position_embeddings
        ),
        activation_checkpointing=checkpointing,
    )
    model = build_model(cfg.model_config(VOCAB), 0, cpu)
    precision = Precision(torch.float32, cpu)
    train_model = parallelize(
        model,
        D.Runtime("single", cpu),
        precision,
        checkpointing=cfg.runtime.activation_checkpointing,
    )
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    for p in model.parameters():  # the AdamW state, allocated as the first step would
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    x = torch.randint(0, VOCAB, (micro, seq))
    batch = Batch.of(x, torch.roll(x, -1, 1), padded=False)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from here
    batch_loss_sum(train_model, batch, precision).backward()
    return {"step_peak_bytes": _status("VmHWM") - before, "resident_bytes": before}


def measured_fsdp(rank: int, port: int, name: str, build: str, out: str) -> None:
    """One FSDP x2 rank (see part 3): its shards' bytes and its peak host memory."""
    from llama_ddp.distributed import runtime as D
    from llama_ddp.distributed.parallelize import (
        Init,
        build_model,
        empty_model,
        parallelize,
        runtime,
    )
    from llama_ddp.precision import Precision
    from llama_ddp.train.optim import build_optimizer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    rt = runtime("fsdp", "cpu")
    start_rss = _status("VmRSS")
    config = shape(name)
    if build == "meta":
        model = empty_model(config)
        parallelize(model, rt, Precision(torch.float32, rt.device), Init(model, 0))
    else:
        model = build_model(config, 0, rt.device)
        parallelize(model, rt, Precision(torch.float32, rt.device))
    built = _status("VmHWM")
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    seconds = []
    for _ in range(2):  # the second step's time: the first allocates the optimizer's state
        optimizer.zero_grad(set_to_none=True)  # as the trainer does after each step
        start = time.perf_counter()
        for micro in range(2):
            if build == "full":  # accumulate unsharded gradients, reduce-scatter on the last
                model.set_requires_gradient_sync(micro == 1)
            x = torch.randint(0, config.vocab_size, (1, 256))
            model(x).float().logsumexp(-1).mean().backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for p in params for v in optimizer.state[p].values() if v.dim() > 0]
    result = {
        "weights": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params),
        "AdamW state": sum(local(v) for v in state),
        "start_rss": start_rss,
        "built_peak": built,
        "peak": _status("VmHWM"),
        "step_s": seconds[-1],
    }
    Path(out, f"{name}-{build}-rank{rank}.json").write_text(json.dumps(result))
    D.teardown(rt)


def fsdp_x2(name: str, build: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.start_processes(
            measured_fsdp, args=(port, name, build, tmp), nprocs=2, start_method="spawn"
        )
        return [json.loads(Path(tmp, f"{name}-{build}-rank{r}.json").read_text()) for r in (0, 1)]


def computed(config: LlamaConfig) -> dict[str, dict[str, float]]:
    n = _count_parameters(config)
    table = {}
    for ranks in (2, 8):
        for mode in ("ddp", "fsdp"):
            share = 1 if mode == "ddp" else ranks
            table[f"{mode} x{ranks}"] = {k: n * b / share for k, b in BYTES.items()}
    return {"parameters": n, "per_rank": table}


def _count_parameters(config: LlamaConfig) -> int:
    c, i, layers, v = (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.vocab_size,
    )
    kv = config.num_key_value_heads * config.head_dim
    per_layer = 2 * c * c + 2 * c * kv + 3 * c * i + 2 * c  # attention, MLP, two norms
    return layers * per_layer + 2 * v * c + c  # embeddings, lm_head (untied), final norm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--presets", default="small,base")
    p.add_argument("--fsdp-shapes", default="small,base", help="presets, 1.1B, 1B-<L>L")
    p.add_argument("--builds", default="meta,full", help="meta (the trainer's), full (before)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=2, metavar=("PRESET", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one configuration in a fresh process
        result = step_memory(args.child[0], args.seq_length, args.micro_batch, args.child[1] == "1")
        print(json.dumps(result))
        return 0
    results: dict = {"activation": {}, "computed": {}, "fsdp_x2": {}}
    for name in args.presets.split(",") if args.presets else []:
        for ac in (False, True):
            cmd = [sys.executable, __file__, "--child", name, str(int(ac))]
            cmd += ["--seq-length", str(args.seq_length), "--micro-batch", str(args.micro_batch)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results["activation"][f"{name}{' + AC' if ac else ''}"] = row
            print(
                f"{name:6} seq {args.seq_length} x{args.micro_batch} "
                f"{'with' if ac else 'without'} activation checkpointing: step peak "
                f"{row['step_peak_bytes'] / 2**20:,.0f} MiB above "
                f"{row['resident_bytes'] / 2**20:,.0f} MiB resident",
                flush=True,
            )
    for name, config in (
        ("base", preset("base", vocab_size=VOCAB)),
        ("1.1B", LlamaConfig(**ONE_B)),
    ):
        results["computed"][name] = computed(config)
        print(f"{name}: {results['computed'][name]['parameters'] / 1e6:,.1f}M parameters")
        for setup, row in results["computed"][name]["per_rank"].items():
            cells = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in row.items())
            print(f"  {setup}: {cells}; total {sum(row.values()) / 2**30:.2f} GiB per rank")
    for name in args.fsdp_shapes.split(","):
        config = shape(name)
        n = _count_parameters(config)
        assert n == empty_model(config).num_parameters()  # the count the table uses
        expected = computed(config)["per_rank"]["fsdp x2"]
        row = results["fsdp_x2"][name] = {"parameters": n, "computed": expected}
        for build in args.builds.split(","):
            ranks = row[build] = fsdp_x2(name, build)
            for r, rank in enumerate(ranks):
                state = sum(rank[k] for k in BYTES)
                print(
                    f"{name} ({n / 1e6:,.0f}M), FSDP x2, {build}, rank {r}: shards "
                    f"{state / 2**20:,.0f} MiB (computed 16/2 bytes per parameter: "
                    f"{sum(expected.values()) / 2**20:,.0f}); peak host memory "
                    f"{rank['peak'] / 2**20:,.0f} MiB ({rank['built_peak'] / 2**20:,.0f}"
                    f" once built; {rank['start_rss'] / 2**20:,.0f} at start); step"
                    f" {rank['step_s']:.2f} s",
                    flush=True,
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
