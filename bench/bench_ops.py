"""Operations per training step: how many aten operations and attention calls one optimizer step
launches, counted by torch's profiler on the CPU (on a GPU: its kernels, and the attention ones).

    python bench/bench_ops.py --json bench/results/ops-cpu.json
    python OTHER_CHECKOUT/bench/bench_ops.py    # another version: its copy reads its package
    python bench/bench_ops.py --device cuda --json bench/results/ops-cuda.json    # bf16

The shape is the `base` preset's depth and heads (12 layers, 12 heads, 3 KV heads) on batches of
micro-batch 8 x 2048 tokens, at a width small enough for a 2-core CPU (hidden 96: the counts do
not depend on the widths, only on the layers and on each batch's documents). Each layout runs one
untimed step, then one profiled step (forward, backward, clipping, AdamW) per batch of a few.
On a GPU each of these operations is at least one kernel launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import sample_paragraphs  # noqa: E402

from llama_ddp.data.corpus import default_cache_dir  # noqa: E402
from llama_ddp.distributed import runtime as D  # noqa: E402
from llama_ddp.train.config import TrainConfig  # noqa: E402
from llama_ddp.train.run import build_trainer  # noqa: E402

LAYOUTS = {
    "pack, documents apart": dict(packing="pack"),
    "pack, plain causal": dict(packing="pack", document_mask=False),
    "pad, short documents": dict(packing="pad", dataset="sample-paragraphs"),
}
ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def count_step(trainer, micro_batches) -> dict[str, int]:
    """The profiler's aten operations (every one, nested ones included) and attention calls of
    one optimizer step; on CUDA also its kernels and the attention ones (flash)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.rt.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.step(micro_batches)
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    counts = {
        "aten_ops": len(events),
        "attention_forward": sum(e.name == ATTENTION[0] for e in events),
        "attention_backward": sum(e.name == ATTENTION[1] for e in events),
    }
    if cuda:
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        counts["cuda_kernels"] = len(kernels)
        counts["attention_kernels"] = sum("flash" in k.lower() for k in kernels)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=96)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (distinct batches)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name, layout in LAYOUTS.items():
        dataset = layout.pop("dataset", "sample")
        if dataset == "sample-paragraphs":  # bench_train.py's short documents
            dataset = str(sample_paragraphs(default_cache_dir()))
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig.from_flags(
                preset="base", hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                seq_length=args.seq_length, batch_size=args.micro_batch, dataset=dataset,
                out_dir=out, optimizer="adamw", **layout,
            )  # fmt: skip
            trainer = build_trainer(cfg, D.setup("single", args.device))
            batches = trainer.data.batches(0)
            trainer.step(next(batches))
            counts = [count_step(trainer, next(batches)) for _ in range(args.steps)]
        results[name] = {k: [c[k] for c in counts] for k in counts[0]}
        cells = ", ".join(
            f"{key} {statistics.median(v):,.0f} ({min(v):,}-{max(v):,})"
            for key, v in results[name].items()
        )
        print(f"{name:24} per step: {cells}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "steps": results}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
