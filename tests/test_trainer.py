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


def test_validation_is_each_document_alone_in_every_packing_mode_and_world_size(
    train_env, tmp_path
):
    """The validation loss scores every held-out token with its own document's earlier context up
    to --seq-length (strided windows beyond): the same value in pad and pack mode, with or
    without document masking, and summed over 2 or 3 ranks' shares; and the value of scoring
    each window alone, one forward each."""
    import torch.nn.functional as F

    from llama_ddp.data import build_data
    from llama_ddp.trainer import token_loss_sum
    from llama_ddp.windows import windows

    cache = ["--cache-dir", str(train_env["root"] / "cache"), "--seq-length", "32"]
    values = []
    for packing in (["pad"], ["pack"], ["pack", "--no-document-mask"]):
        args = tiny_args(train_env, tmp_path, "--packing", *packing, *cache, "--batch-size", "12")
        cfg = parse_train_args(args)
        trainer = build_trainer(cfg, D.setup("single", "cpu"))
        values.append(trainer.evaluate())
    model, precision = trainer.model, trainer.precision
    for world_size in (2, 3):
        total, count = 0.0, 0
        for rank in range(world_size):
            rt = D.Runtime("single", torch.device("cpu"), rank=rank, world_size=world_size)
            with torch.no_grad():
                for b in build_data(cfg, rt).validation_batches(rt):
                    total += token_loss_sum(model, b, precision).item()
                    count += b.targets
        values.append(total / count)
    split = trainer.data.validation.split
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(split.offsets[:-1].tolist(), split.offsets[1:].tolist()):
            doc = torch.as_tensor(split.tokens[a:b].astype("int64"))
            for start, end, first in windows(b - a, 32):
                logits = model(doc[None, start:end])[0, first - start :]
                total += F.cross_entropy(logits, doc[first + 1 : end + 1], reduction="sum").item()
                count += end - first
    assert count == split.num_tokens - split.num_docs
    assert max(b - a for a, b in zip(split.offsets[:-1], split.offsets[1:])) > 33  # strided too
    assert values == pytest.approx([total / count] * 5, rel=1e-6)
