"""Training steps on a GPU under CUDA's sync-debug mode: any host-device synchronization in a step
is an error (run by tests/test_gpu.py; directly, or under torchrun for DDP and FSDP).

    python tests/helpers/gpu_steps.py TRAIN_PY_FLAGS...
    torchrun --standalone --nproc_per_node=1 tests/helpers/gpu_steps.py --mode fsdp FLAGS...
"""

from __future__ import annotations

import sys

import torch

from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import runtime
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import build_trainer


def main(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    rt = runtime(cfg.runtime.mode, cfg.runtime.device)
    try:
        trainer = build_trainer(cfg, rt)
        batches = trainer.data.batches(0)
        for _ in range(2):  # optimizer state, compiled graphs, caches and allocator warmed up
            trainer.step(next(batches))
        steps = [next(batches) for _ in range(3)]  # the loader's work is not the step's
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            results = [trainer.step(micro_batches) for micro_batches in steps]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stats = [r.stats() for r in results]
        assert all(s.targets > 0 and s.grad_norm > 0 for s in stats), stats
        print(f"{rt.mode}: 3 steps without a synchronization", flush=True)
    finally:
        D.teardown(rt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
