"""checkpoint/manager.py: when a run saves, into which folder, and what it keeps."""

import os
import signal
import threading

import pytest
import torch

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import Checkpointer, Worker, step_of
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import Interrupted, WriteFailed
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
    checkpointer.wait()
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


def test_a_save_returns_before_its_write_and_the_folder_appears_complete_only_after(
    tmp_path, monkeypatch
):
    """The write (held back here, as a slow disk would) goes on after ``save`` returns, of the
    state as it was at ``save``: training may change it meanwhile. No folder appears before the
    write is complete; then it is intact, reported once by ``completed``; the next save waits
    for it (one in flight at most)."""
    write, release = ckpt.save_checkpoint, threading.Event()

    def slow_write(*args, **kwargs):
        assert release.wait(timeout=30)
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", slow_write)
    checkpointer = make(tmp_path)
    state = checkpointer.parts["train"]
    state.step, state.source_tokens = 4, {"a": 1}
    blocked = checkpointer.save(4)
    state.step, state.source_tokens["a"] = 8, 2  # the next steps train on
    assert checkpointer.writer.is_alive() and checkpointer.completed() == []
    assert checkpointer.saved() == {}  # nothing under its final name yet
    second = threading.Thread(target=checkpointer.save, args=(8,))
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive()  # the next save waits for the write in flight
    release.set()
    second.join()
    checkpointer.wait()
    assert [ckpt.verify_checkpoint(checkpointer.folder(s)) for s in (4, 8)] == [None, None]
    (step, seconds, kept), (next_step, *_) = checkpointer.completed()
    assert (step, kept, next_step) == (4, blocked, 8) and seconds >= blocked
    assert checkpointer.completed() == []
    fresh = make(tmp_path)
    assert fresh.load(checkpointer.folder(4)) == 4
    assert (fresh.parts["train"].step, fresh.parts["train"].source_tokens) == (4, {"a": 1})
    assert fresh.load(checkpointer.folder(8)) == 8 and fresh.parts["train"].source_tokens == {
        "a": 2
    }


def test_a_failed_background_write_is_raised_by_the_loop_and_leaves_the_last_checkpoint(
    tmp_path, monkeypatch
):
    """A write that fails halfway (its files written, never renamed) is raised at the loop's
    next wait; it leaves no temporary folder, and the checkpoint before it stays the newest,
    intact."""
    from llama_ddp.files import safe_io

    checkpointer = make(tmp_path)
    checkpointer.save(4)
    checkpointer.wait()

    def torn(tmp, final):
        raise WriteFailed(f"cannot write checkpoint {final}: disk full")

    monkeypatch.setattr(safe_io, "replace_dir", torn)
    checkpointer.save(8)
    with pytest.raises(WriteFailed, match="disk full"):
        checkpointer.wait()
    assert list(checkpointer.saved()) == [4] and [c[0] for c in checkpointer.completed()] == [4]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]
    assert ckpt.verify_checkpoint(checkpointer.folder(4)) is None


def test_prepare_makes_the_first_saves_buffers_ahead_and_the_save_copies_into_them(tmp_path):
    """``prepare`` (after the first step) makes the host buffers in a thread; the first save
    then copies into those very buffers, with the values of save time, not of prepare time."""
    model = torch.nn.Linear(8, 4)
    checkpointer = make(tmp_path)
    checkpointer.parts["model"] = ckpt.ModelState(model)
    checkpointer.prepare()
    checkpointer.staged.reserving.join()
    made = dict(checkpointer.staged.buffers)
    assert {"/".join(k) for k in made} >= {"model/weight", "model/bias"}
    with torch.no_grad():
        model.weight.fill_(3.0)  # training goes on between prepare and the save
    tensors, _ = checkpointer.staged.stage(checkpointer.parts)
    assert tensors["model"]["weight"] is made[("model", "weight")]
    assert torch.equal(tensors["model"]["weight"], torch.full((4, 8), 3.0))
    assert checkpointer.staged.buffers == made  # nothing made at the save itself


def test_a_finished_save_is_reported_while_the_next_one_is_written(tmp_path, monkeypatch):
    """Save 4 completes, save 8 starts (joining 4's writer) and is held back: ``completed``
    reports 4 at once, not after 8 (a run's after-save hook, and its log, learn of 4 before the
    next write ends: under load a write can outlast several steps)."""
    write, release = ckpt.save_checkpoint, threading.Event()

    def held_for_8(final, step, *args, **kwargs):
        assert step != 8 or release.wait(timeout=30)
        return write(final, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", held_for_8)
    checkpointer = make(tmp_path)
    checkpointer.save(4)
    checkpointer.save(8)  # waits for 4's write, then 8's is held back
    assert checkpointer.writer.is_alive()
    assert [c[0] for c in checkpointer.completed()] == [4]
    release.set()
    checkpointer.wait()
    assert [c[0] for c in checkpointer.completed()] == [8]


def test_abandon_stops_the_write_in_flight_between_its_tensors_and_removes_its_folder(
    tmp_path, monkeypatch
):
    """A person's second Ctrl-C (`Checkpointer.abandon`) while a background write is inside
    DCP: the write stops before its next tensor, its temporary folder is removed, and abandon
    returns only once the writer thread has ended (the process may then leave: no thread of
    ours still runs torch's code when the interpreter finalizes). The checkpoint before it stays
    intact; the stopped write is neither reported nor raised."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    checkpointer = make(tmp_path)
    checkpointer.parts["model"] = ckpt.ModelState(torch.nn.Linear(8, 4))
    checkpointer.save(4)
    checkpointer.wait()
    resolve, seen, inside = DefaultSavePlanner.resolve_data, [], threading.Event()

    def held(planner, item):  # the first item handed to the writer waits for the abandon
        if not seen:
            seen.append(sorted(p.name for p in (tmp_path / "checkpoints").iterdir()))
            inside.set()
            assert checkpointer.stop.wait(timeout=30)
        return resolve(planner, item)

    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", held)
    checkpointer.save(8)
    writer = checkpointer.writer
    assert inside.wait(timeout=30)
    checkpointer.abandon()
    assert not writer.is_alive() and checkpointer.writer is None
    assert seen == [[f".step-00000008.tmp-{os.getpid()}", "step-00000004"]]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]
    assert ckpt.verify_checkpoint(checkpointer.folder(4)) is None
    assert [c[0] for c in checkpointer.completed()] == [4]  # and no error raised
    checkpointer.abandon()  # nothing in flight: nothing to do


def test_a_worker_still_running_after_a_join_a_signal_interrupted_is_waited_for():
    """A second Ctrl-C raises in the main thread while it joins the writer; `Thread.join` then
    believes the thread stopped (Python up to 3.12) and the interpreter would finalize under it.
    A `Worker` is still alive after such a join, and the next join waits for its end."""
    release = threading.Event()
    worker = Worker(release.wait, (30,), "llama_ddp-checkpoint-test")

    def interrupt(signum, frame):
        raise Interrupted(signum, "again")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            worker.join()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert worker.is_alive()
    threading.Timer(0.1, release.set).start()
    worker.join()
    assert not worker.is_alive() and release.is_set()
