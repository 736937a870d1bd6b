"""checkpoint/manager.py: when a run saves, into which folder, and what it keeps."""

import torch

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import Checkpointer, step_of
from llama_ddp.distributed import runtime as D
from llama_ddp.train.trainer import TrainState


def make(tmp_path, every: int = 4, keep_last: int = 2) -> Checkpointer:
    state = TrainState()
    parts = {"train": state, "rng": ckpt.RNGState()}
    rt = D.Runtime("single", torch.device("cpu"))
    return Checkpointer(tmp_path, parts, rt, every=every, keep_last=keep_last, collective=False)


def test_saves_are_due_every_n_steps_and_at_the_end(tmp_path):
    every4, at_end = make(tmp_path, every=4), make(tmp_path, every=0)
    assert [s for s in range(0, 11) if every4.due(s, last=s == 10)] == [4, 8, 10]
    assert [s for s in range(0, 11) if at_end.due(s, last=s == 10)] == [10]
    assert not every4.due(0, last=True)  # nothing to save before the first step


def test_folders_are_named_by_step_and_the_newest_are_kept(tmp_path):
    checkpointer = make(tmp_path, keep_last=2)
    for step in (4, 8, 12):
        checkpointer.parts["train"].step = step
        assert checkpointer.save(step) > 0
    assert checkpointer.folder(8) == tmp_path / "checkpoints" / "step-00000008"
    assert step_of(checkpointer.folder(8)) == 8
    assert list(checkpointer.saved()) == [8, 12] and checkpointer.latest() == checkpointer.folder(
        12
    )
    fresh = make(tmp_path)
    assert fresh.load(checkpointer.latest()) == 12 and fresh.parts["train"].step == 12
    rt = D.Runtime("single", torch.device("cpu"))
    assert Checkpointer.resume_point(tmp_path, "auto", rt) == checkpointer.folder(12)
    assert Checkpointer.resume_point(tmp_path / "elsewhere", "auto", rt) is None
