"""The loop in-process: what a training step asks of the device."""

import sys

import pytest
import torch
from conftest import tiny_args

from llama_ddp import distributed as D
from llama_ddp.cli import parse_train_args
from llama_ddp.run import build_trainer

# Tensor methods that copy a value to the host, which on CUDA waits for all queued work.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads of tensors, except of two kinds of CPU tensors that never live on the
    device: the optimizer's step counters (foreach AdamW's; on CUDA the fused AdamW keeps them on
    the device and reads none) and the batch's masks and document ids, which layout.py plans
    the model's layout with on the CPU. (The `gpu` test runs the same steps under CUDA's
    sync-debug mode.)"""
    calls, exempt = [], set()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            planning = sys._getframe(1).f_code.co_filename.endswith("layout.py")
            if id(self) not in exempt and not planning:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls, exempt


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_a_training_step_never_waits_for_the_device(train_env, tmp_path, host_reads, packing):
    args = tiny_args(train_env, tmp_path, "--packing", packing, "--micro-batch-size", "4")
    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    trainer = build_trainer(cfg, D.setup("single", "cpu"))
    batches = trainer.data.batches(0)
    trainer.train_step(next(batches), False)  # creates the optimizer state
    steps = [next(batches) for _ in range(3)]  # the loader's work is the CPU's, not the step's
    calls, exempt = host_reads
    exempt.update(id(s["step"]) for s in trainer.optimizer.state.values())
    calls.clear()
    results = [trainer.train_step(micro_batches, False) for micro_batches in steps]
    assert calls == []  # before: a .tolist() of the gradient norm and counts every step
    pending = [(i + 2, r) for i, r in enumerate(results)]
    assert trainer.settle(pending, keep=1) is False and len(pending) == 1  # lagged read-back
    assert results[0].tokens > 0 and results[0].grad_norm > 0
    assert calls == []  # read back through pinned host copies, not tensor reads
