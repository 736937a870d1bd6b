"""The run's checkpointing component and its settings (CheckpointSettings: --out-dir, --save-every,
--keep-last, --resume): when to save, into which folder, by whom, how many to keep,
and which checkpoint a run resumes from. The format itself (parts, DCP + JSON, verification) is
state.py's; the loop asks ``due``, calls ``save`` (which writes in the background) and learns
which saves are complete from ``completed``.

A run's checkpoints are ``OUT/checkpoints/step-NNNNNNNN/``, one per saved optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.files import safe_io
from llama_ddp.settings import Settings, setting

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(out_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after optimizer step ``step``."""
    return Path(out_dir) / CHECKPOINTS / f"step-{step:08d}"


def step_of(path: str | Path) -> int:
    """The optimizer step a checkpoint folder (``step-NNNNNNNN``) was taken after."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step-NNNNNNNN)")
    return int(match.group(1))


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders, oldest first (temporary ones are never listed)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def find_resume(out_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: ``auto`` the newest complete one in ``out_dir``
    (`newest_complete`), ``none`` none, anything else a path that must be intact."""
    if resume == "none":
        intact = [p for p in list_checkpoints(out_dir) if ckpt.verify_checkpoint(p) is None]
        if intact:
            raise UserError(
                f"{out_dir} already holds checkpoints of a run (newest {intact[-1].name}); "
                "continue it with --resume auto, or choose another --out-dir"
            )
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"checkpoint {path} not found (give a checkpoints/step-* folder)")
        problem = ckpt.verify_checkpoint(path)
        if problem:
            raise UserError(
                f"checkpoint {path} is not usable: {problem} (resume from another checkpoint)"
            )
        return path
    return newest_complete(out_dir)


_LOOKS = 10  # listings of a folder whose checkpoints keep changing while they are checked


def newest_complete(out_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``out_dir`` that is complete when it looks, warning about each
    damaged one it skips. A run still training saves and prunes meanwhile: a checkpoint gone by
    the time it is checked (pruned: `prune`) is skipped without a word, and when none is left
    complete the folder is listed again, while its listing keeps changing."""
    warned: set[Path] = set()
    listing: list[Path] | None = None
    for _ in range(_LOOKS):
        before, listing = listing, list_checkpoints(out_dir)
        if listing == before:  # nothing saved or pruned since the last look: none is complete
            return None
        for path in reversed(listing):
            problem = ckpt.verify_checkpoint(path)
            if problem is None:
                return path
            if path.is_dir() and path not in warned:
                warned.add(path)
                print(f"warning: skipping unusable checkpoint {path}: {problem}", file=sys.stderr)
    return None


def prune(path: Path) -> None:
    """Remove the checkpoint folder ``path`` at once as a reader sees it: renamed out of the
    listing (to a temporary name the next run removes if this one is killed), then deleted, so
    that no reader finds it half deleted under its own name."""
    gone = path.with_name(f".{path.name}.tmp-pruned")
    shutil.rmtree(gone, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        path.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)


def remove_shard_leftovers(out_dir: str | Path) -> None:
    """Remove the temporary folders of collective saves from ``out_dir``'s checkpoints: what a
    killed run left on a node's own disk, which rank 0 never sees. Call on ranks other than 0
    once rank 0 holds the run lock, and before the run's first save (`run.run`)."""
    for path in (Path(out_dir) / CHECKPOINTS).glob(".step-*.tmp-shared"):
        shutil.rmtree(path, ignore_errors=True)


class SaveStopped(Exception):
    """A background write stopped by `Checkpointer.abandon` before its next tensor."""


def _stoppable_planner(stop: threading.Event) -> Any:
    """DCP's default save planner, except that once ``stop`` is set it raises SaveStopped
    instead of handing DCP's writer its next tensor: the write fails there, as a refused one
    does, and removes its temporary folder (`ckpt.save_checkpoint`)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Stoppable(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if stop.is_set():
                raise SaveStopped("the checkpoint's write was abandoned")
            return super().resolve_data(write_item)

    return Stoppable()


class Worker:
    """A thread whose end is an Event, the one wait a signal cannot spoil: up to Python 3.12, a
    `Thread.join` that a signal handler's exception interrupts (a second Ctrl-C) marks the
    thread stopped while it still runs (the bpo-45274 branch of the threading module), after
    which its ``join`` and ``is_alive`` return at once."""

    def __init__(self, target: Callable[..., object], args: tuple, name: str) -> None:
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(target, args), name=name)
        self.thread.start()

    def _run(self, target: Callable[..., object], args: tuple) -> None:
        try:
            target(*args)
        finally:
            self.done.set()

    def join(self) -> None:
        self.done.wait()

    def is_alive(self) -> bool:
        return not self.done.is_set()


class Staged:
    """The parts' state at one step, apart from the live objects, so that a thread can write it
    while training changes them: ``tensors`` (DCP's) copied to the host, ``plain`` (state.json's)
    deep-copied. A host buffer of each tensor is kept for the next save (pinned on CUDA, where
    the copies are non-blocking and one synchronization waits for them all). ``reserve`` makes
    the buffers ahead of the first save, in a thread: pinning a base run's 1.4 GB of state takes
    about a second, which the first save would otherwise keep training waiting."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self.reserving: Worker | None = None

    def reserve(self, parts: dict[str, ckpt.Stateful]) -> None:
        """Start making the host buffers of ``parts``' tensors (their shapes as now: call it once
        the optimizer holds its state, after the first step)."""
        tensors, _ = ckpt.split_parts(parts)
        self.reserving = Worker(self._walk, (tensors, (), None), "llama_ddp-staging")

    def stage(self, parts: dict[str, ckpt.Stateful]) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.reserving is not None:
            self.reserving.join()
            self.reserving = None
        tensors, plain = ckpt.split_parts(parts)
        devices: set[torch.device] = set()
        copied = self._walk(tensors, (), devices)
        for device in devices:  # the non-blocking copies into the pinned buffers
            torch.cuda.synchronize(device)
        return copied, copy.deepcopy(plain)

    def _walk(self, tree: Any, path: tuple[str, ...], devices: set[torch.device] | None) -> Any:
        """``tree`` copied into its buffers (made where missing); ``devices`` None: make them."""
        if isinstance(tree, dict):
            return {k: self._walk(v, (*path, str(k)), devices) for k, v in tree.items()}
        t = tree.detach()
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self.buffers[path] = buffer
        if devices is None:
            return None
        if t.is_cuda:
            devices.add(t.device)
        return buffer.copy_(t, non_blocking=t.is_cuda)


class Checkpointer:
    """Saves the run's ``parts`` every ``every`` steps and after the last one (``due``), into
    ``OUT/checkpoints/step-NNNNNNNN/``, keeping the newest ``keep_last``.

    With ``background`` (the default), ``save`` stages the state (a copy on the host, `Staged`)
    and returns while a thread writes it: training goes on during the write. At most one save is
    in flight: the next ``save`` waits for the previous one first; ``wait`` waits for it (every
    rank, before it leaves the run or stops for a signal), and ``completed`` says which saves
    have finished since it was last asked; ``abandon`` stops it (a person's second Ctrl-C). A
    killed run leaves at most a temporary folder (the next run removes it) and every complete
    checkpoint intact.

    Its threads (`Worker`) are never left running when the process leaves: a thread inside
    torch's C++ code while the interpreter finalizes is ended by Python (before 3.14) with
    pthread_exit as it comes back to Python, which the C++ frames turn into std::terminate
    ("terminate called without an active exception", exit 134), or it touches freed interpreter
    state (a segmentation fault, exit 139, or a "Fatal Python error"). Every way out of the loop
    waits for them (``wait``, ``close``, ``abandon``), and they are not daemons.

    With ``collective`` (sharded weights) every rank writes its shards and rank 0 completes the
    folder, in ``save`` itself; otherwise rank 0 writes it alone. ``on_complete(step)`` runs on
    rank 0 as each folder completes, in the thread that wrote it (the after-save fault)."""

    def __init__(
        self,
        out_dir: str | Path,
        parts: dict[str, ckpt.Stateful],
        rt: D.Runtime,
        *,
        every: int,
        keep_last: int,
        collective: bool,
        background: bool = True,
        on_complete: Callable[[int], object] | None = None,
    ) -> None:
        self.out_dir, self.parts, self.rt, self.on_complete = Path(out_dir), parts, rt, on_complete
        self.every, self.keep_last, self.collective = every, keep_last, collective
        self.background = background and not collective
        self.staged = Staged()
        self.pending: int | None = None  # the step of the save in flight, on every rank
        self.writer: Worker | None = None
        self.stop = threading.Event()  # set by abandon: the write in flight stops
        self.error: BaseException | None = None
        self.done: list[tuple[int, float]] = []  # saves finished, not yet reported
        self.blocked: dict[int, float] = {}  # the seconds each save kept its caller

    def due(self, step: int, last: bool) -> bool:
        """Whether optimizer step ``step`` (1-based; ``last``: the run's final one) saves."""
        return step > 0 and (last or (self.every > 0 and step % self.every == 0))

    def save(self, step: int) -> float:
        """Save the checkpoint of step ``step``: the seconds it kept the caller (as rank 0 saw
        them). In the background, the write goes on after it returns (``completed``)."""
        start = time.perf_counter()
        self.wait()
        final = self.folder(step)
        self.pending = step
        if self.background:
            if self.rt.is_main:
                staged = self.staged.stage(self.parts)
                self.writer = Worker(
                    self._write, (final, step, staged, start), f"llama_ddp-checkpoint-{step}"
                )
        else:
            if self.collective or self.rt.is_main:
                self._write(final, step, None, start)
            self.wait()
        self.blocked[step] = time.perf_counter() - start
        return self.blocked[step]

    def _write(self, final: Path, step: int, staged: tuple | None, start: float) -> None:
        try:
            planner = _stoppable_planner(self.stop) if staged is not None else None
            ckpt.save_checkpoint(
                final,
                step,
                self.parts,
                rt=self.rt,
                collective=self.collective,
                staged=staged,
                planner=planner,
            )
            if self.rt.is_main:
                # Prune only older checkpoints: a newer one (skipped as damaged, or beyond a
                # --resume PATH) is not this run's to delete.
                older = [p for p in list_checkpoints(self.out_dir) if p.name < final.name]
                for stale in older[: max(0, len(older) - (self.keep_last - 1))]:
                    prune(stale)
            self.done.append((step, time.perf_counter() - start))
            if self.rt.is_main and self.on_complete is not None:
                self.on_complete(step)
        except BaseException as exc:  # raised by the caller's next wait or completed
            self.error = exc

    def wait(self) -> None:
        """Return once the save in flight (if any) is complete, on every rank; raise its error."""
        if self.pending is None:
            return
        self.close()
        self.writer = self.pending = None
        self._raise()
        D.barrier(self.rt)  # every rank goes on only once the checkpoint is complete

    def prepare(self) -> None:
        """Make the host buffers of a background save now, in a thread (`Staged.reserve`), so
        that the first save only copies; call once the optimizer holds its state."""
        if self.background and self.rt.is_main and self.staged.reserving is None:
            self.staged.reserve(self.parts)

    def close(self) -> None:
        """Let a write in flight finish, without waiting for the other ranks (a run that fails:
        its last checkpoint still completes)."""
        if self.writer is not None:
            self.writer.join()

    def abandon(self) -> None:
        """Stop the save in flight, for a process that leaves at once (a person's second
        Ctrl-C; no barrier, nothing raised): its write stops before its next tensor and removes
        its temporary folder (one already past its tensors completes, checksums and rename).
        Returns once no thread of the checkpointer runs."""
        self.stop.set()
        for worker in (self.staged.reserving, self.writer):
            if worker is not None:
                worker.join()
        self.staged.reserving = self.writer = self.pending = self.error = None

    def completed(self) -> list[tuple[int, float, float]]:
        """The saves that finished since the last call, on rank 0: (step, seconds from ``save``
        to the complete folder, seconds ``save`` kept its caller); a write's error is raised
        here. A save that finished is reported even while the next one is being written (the
        next ``save`` joined its writer), so that a run killed then knows it was complete."""
        if self.writer is not None and not self.writer.is_alive():
            self.writer.join()
            self.writer = None
        self._raise()
        done, self.done = self.done, []
        return [(step, seconds, self.blocked.pop(step, 0.0)) for step, seconds in done]

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def load(self, path: Path) -> int:
        """Load every part from ``path`` (all ranks together when collective): its step."""
        return ckpt.load_checkpoint(path, self.parts, rt=self.rt, collective=self.collective)

    def folder(self, step: int) -> Path:
        return step_dir(self.out_dir, step)

    def saved(self) -> dict[int, Path]:
        """This run folder's checkpoints by step, oldest first."""
        return {step_of(p): p for p in list_checkpoints(self.out_dir)}

    def latest(self) -> Path | None:
        return (list_checkpoints(self.out_dir) or [None])[-1]

    @staticmethod
    def resume_point(out_dir: str | Path, resume: str, rt: D.Runtime) -> Path | None:
        """The checkpoint a run continues from (``--resume``: auto, none or a path; see
        `checkpoint.find_resume`): rank 0 decides, every rank gets its answer."""
        path = D.broadcast_object(find_resume(out_dir, resume) if rt.is_main else None, rt)
        return None if path is None else Path(path)


@dataclass
class CheckpointSettings(Settings):
    """The run folder and its checkpoints: how often they are saved, how many are kept, and
    which one a run resumes."""

    out_dir: str = setting("out", "the run folder: checkpoints, metrics, exported model")
    save_every: int = setting(0, "checkpoint every N steps; 0: only at the end")
    keep_last: int = setting(
        2, "checkpoints kept; older ones are pruned once a newer one is complete"
    )
    resume: str = setting(
        "auto", "auto (newest complete checkpoint in out_dir, if any), none, or a checkpoint folder"
    )

    def check(self) -> None:
        self.positive("keep_last")
        self.non_negative("save_every")
        if not self.out_dir.strip():  # an unset variable in a script: the files would go to "."
            raise UserError(
                "--out-dir is empty, which would put the run's files in the current folder "
                "(give a folder, e.g. --out-dir out)"
            )
        safe_io.check_name_length(self.out_dir, "--out-dir")
