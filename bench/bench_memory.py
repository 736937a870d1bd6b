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
3. The same for the `small` preset under FSDP x2, measured: two gloo processes shard the model
   with the trainer's parallelize(), take one step, and sum the bytes of their local shards.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_ddp.config import TrainConfig  # noqa: E402
from llama_ddp.model import LlamaForPretraining  # noqa: E402
from llama_ddp.model_config import LlamaConfig, preset  # noqa: E402

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


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def step_memory(preset_name: str, seq: int, micro: int, checkpointing: bool) -> dict:
    """One step's peak memory above the resident model and optimizer state (this process)."""
    from llama_ddp import distributed as D
    from llama_ddp.data import Batch
    from llama_ddp.loss import batch_loss_sum
    from llama_ddp.optim import build_optimizer
    from llama_ddp.parallelize import build_model, parallelize
    from llama_ddp.precision import Precision

    cpu = torch.device("cpu")
    cfg = TrainConfig(
        preset=preset_name,
        seq_length=seq,
        max_position_embeddings=max(
            seq, preset(preset_name, vocab_size=VOCAB).max_position_embeddings
        ),
        activation_checkpointing=checkpointing,
    )
    model = build_model(cfg.model_config(VOCAB), 0, cpu)
    precision = Precision(torch.float32, cpu)
    train_model = parallelize(model, D.Runtime("single", cpu), cfg, precision)
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


def measured_fsdp_state(rank: int, port: int, preset_name: str, out: str) -> None:
    """One FSDP x2 rank: the bytes of its local shards of weights, gradients, AdamW state."""
    from llama_ddp import distributed as D
    from llama_ddp.optim import build_optimizer
    from llama_ddp.parallelize import build_model, parallelize, runtime
    from llama_ddp.precision import Precision

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    rt = runtime("fsdp", "cpu")
    cfg = TrainConfig(preset=preset_name, seq_length=64)
    model = build_model(cfg.model_config(VOCAB), 0, rt.device)
    parallelize(model, rt, cfg, Precision(torch.float32, rt.device))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(torch.randint(0, VOCAB, (2, 64))).float().mean().backward()
    optimizer.step()

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for p in params for v in optimizer.state[p].values() if v.dim() > 0]
    result = {
        "weights": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params),
        "AdamW state": sum(local(v) for v in state),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    D.teardown(rt)


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
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=2, metavar=("PRESET", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one configuration in a fresh process
        result = step_memory(args.child[0], args.seq_length, args.micro_batch, args.child[1] == "1")
        print(json.dumps(result))
        return 0
    results: dict = {"activation": {}, "computed": {}, "measured_fsdp_x2_small": {}}
    for name in args.presets.split(","):
        for ac in (False, True):
            cmd = [sys.executable, __file__, "--child", name, str(int(ac))]
            cmd += ["--seq-length", str(args.seq_length), "--micro-batch", str(args.micro_batch)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results["activation"][f"{name}{' + AC' if ac else ''}"] = row
            print(
                f"{name:6} seq {args.seq_length} x{args.micro_batch} "
                f"{'with' if ac else 'without'} activation checkpointing: step peak "
                f"{row['step_peak_bytes'] / 2**20:,.0f} MiB above {row['resident_bytes'] / 2**20:,.0f}"
                " MiB resident",
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
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.start_processes(
            measured_fsdp_state, args=(port, "small", tmp), nprocs=2, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    small_config = preset("small", vocab_size=VOCAB)
    small = computed(small_config)
    assert small["parameters"] == LlamaForPretraining(small_config).num_parameters()
    expected = small["per_rank"]["fsdp x2"]
    results["measured_fsdp_x2_small"] = {"ranks": ranks, "computed": expected}
    for r, row in enumerate(ranks):
        cells = ", ".join(
            f"{k} {v / 2**20:.2f} MiB (computed {expected[k] / 2**20:.2f})" for k, v in row.items()
        )
        print(f"small, FSDP x2, rank {r} measured: {cells}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
