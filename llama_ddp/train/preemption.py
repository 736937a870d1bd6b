"""Preemption: SIGTERM/SIGINT ask a run to stop cleanly, and what "cleanly" means depends on
what the run is doing.

- Preparing (corpus, tokenizer, token cache, model): there is nothing to save yet, so a signal
  stops at once (`Interrupted`, exit 128 + signal), and no checkpoint is written; one whose
  `Interrupted` was caught stops the run at ``training()``, and under torchrun a worker that
  waits in C++ for a peer that left is ended 5 s after the signal (`Watchdog`).
- Training: the first signal is recorded; at the next step boundary every rank votes (a signal
  seen by any rank stops all), saves a checkpoint and leaves (exit 128 + signal). The save must
  fit in the grace period before the SIGKILL (`grace_seconds`, `slow_save_warning`). A repeated
  SIGTERM is ignored: schedulers and torchrun send several (`scancel`, `kill -TERM -PGID`, then
  torchrun to its workers), and each must not cost the checkpoint. A second SIGINT, a person
  pressing Ctrl-C again, aborts at once: a save in progress stops and removes its temporary
  folder, in the step (checkpoint/state.py) or in the background, where the process waits for
  the writer thread to stop before its next tensor (`Checkpointer.abandon`); every complete
  checkpoint stays intact, and signals after that abort are ignored while it stops.
- After the last step (its evaluation and save, then the export; `Preemption.since_training`):
  what is under way finishes, and one line says what was done (`Preemption.late_line`): a signal
  before the export leaves the run saved, unexported (exit 128 + signal); one during the export
  comes once everything is done (exit 0).

Fault injection, the test hook of the fault-tolerance tests.

``LLAMA_DDP_FAULT=<point>:<step>`` makes rank 0 SIGKILL itself when the trainer reaches that point
of that step, once per run folder (a marker file records it, so a restarted job runs on);
``<point>:<step>:sleep=<seconds>`` makes rank 0 stall there instead (a slow disk, a large save),
at every such point when the step is ``any``. Points: ``after-step`` (the step's maths done, before
its log, evaluation and checkpoint), ``before-save`` (rank 0 about to write a checkpoint),
``after-save`` (the checkpoint's folder complete: in the thread that wrote it, before any later
save begins, however far training went on meanwhile). A spec of another form is a UserError.
The environment is read once, by the command line; the trainer and its checkpointer receive the
hook at construction and call it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from llama_ddp.errors import Interrupted, UserError

AGAIN = "again: stopped at once, nothing saved since the last checkpoint"
PREPARING = "while preparing, before any training: nothing was saved"
# A worker still there this long after a signal while preparing is stuck (see Watchdog).
LEAVE_S = 5.0


class Preemption:
    """Installs the handlers for its ``with`` block; ``training()`` ends the preparation phase,
    after which ``signum`` (polled by the trainer once per step) holds the first signal."""

    def __init__(self) -> None:
        self.signum = 0
        self.preparing = True
        self.aborted = False  # a second Ctrl-C raised: the run is leaving
        self._previous: dict[int, object] = {}
        self._deferring = self._owed = False  # in `deferred`; an abort it holds back
        self.early = 0  # a signal while preparing
        self._watchdog: Watchdog | None = None

    def __enter__(self) -> Preemption:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        grace = grace_seconds()
        self._watchdog = None if grace is None else Watchdog(self, min(LEAVE_S, grace / 2))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def training(self) -> None:
        """Preparation is over: from now on a signal asks for a checkpoint first. A signal that
        came while preparing and whose `Interrupted` something caught (a kernel's trial that
        takes any exception for a refusal) stops the run here."""
        if self.early:
            raise Interrupted(self.early, PREPARING)
        self.preparing = False

    def since_training(self, vote: Callable[[bool], bool]) -> int:
        """The signal that came after the training loop's last stop vote (during the final
        evaluation, its save or the export), as every rank takes it (``vote``: whether any rank
        saw one), SIGTERM where this rank saw none; 0: none came."""
        return (self.signum or signal.SIGTERM) if vote(self.signum != 0) else 0

    @staticmethod
    def late_line(signum: int, step: int, checkpoint: Path | None, exported: bool) -> str:
        """The line of a signal `since_training`: what the run finished before leaving (exit
        128 + signum where it left the export undone, 0 where it was complete)."""
        done = f"trained to step {step}, evaluated and saved {checkpoint}"
        if exported:
            return f"signal {signum} came during the export: the run is complete ({done}, exported)"
        return (
            f"stopped by signal {signum} after the last step: {done}; not exported (the same "
            "command exports it, resuming there)"
        )

    def _handle(self, signum: int, frame: object) -> None:
        if self.preparing:
            self.early = self.early or signum
            raise Interrupted(signum, PREPARING)
        if not self.signum:
            self.signum = signum
        elif signum == signal.SIGINT and not self.aborted:
            self.aborted = True
            self._owed = self._deferring
            if not self._owed:
                raise Interrupted(signum, AGAIN)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a second Ctrl-C does not cut short (the metrics lines of the complete
        checkpoints): its abort is raised once the block ends."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._owed:
            self._owed = False
            raise Interrupted(signal.SIGINT, AGAIN)


class Watchdog:
    """Under torchrun, ends a process that a signal while preparing did not end within
    ``deadline`` seconds (exit 128 + signal, `Interrupted`'s line on rank 0), well before
    torchrun's SIGKILL. Python runs a signal's handler only between bytecodes of the main thread,
    and a worker waiting in C++ for a peer (in the rendezvous store while the process groups
    form, as the peer, signalled too, has already left) runs none until the wait times out; the
    signal's number still reaches a file descriptor at once (`signal.set_wakeup_fd`), which this
    thread reads."""

    def __init__(self, preemption: Preemption, deadline: float) -> None:
        self.read, self.write = socket.socketpair()
        self.write.setblocking(False)
        self.closed = threading.Event()
        self.previous = signal.set_wakeup_fd(self.write.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(
            target=self._watch, args=(preemption, deadline), name="llama_ddp-watchdog", daemon=True
        )
        self.thread.start()

    def _watch(self, preemption: Preemption, deadline: float) -> None:
        while not self.closed.is_set():
            signals = [s for s in self.read.recv(64) if s in (signal.SIGTERM, signal.SIGINT)]
            if signals and preemption.preparing and not self.closed.wait(deadline):
                if os.environ.get("RANK", "0") == "0":
                    print(
                        f"stopped by signal {signals[0]} {PREPARING}", file=sys.stderr, flush=True
                    )
                os._exit(128 + signals[0])

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous)
        self.closed.set()
        self.write.send(b"\0")  # wakes the thread's read
        self.thread.join()
        self.read.close()
        self.write.close()


# torchrun SIGKILLs its workers this long after it forwards a SIGTERM (its --shutdown-timeout).
TORCHRUN_GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_GRACE_DEFAULT = 30.0


def grace_seconds() -> float | None:
    """How long a stopping worker has under torchrun between its SIGTERM and the SIGKILL, as far
    as this process can tell: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (which torchrun reads too), else
    torchrun's default. None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return float(os.environ.get(TORCHRUN_GRACE_ENV, TORCHRUN_GRACE_DEFAULT))
    except ValueError:
        return TORCHRUN_GRACE_DEFAULT


def save_time_note(seconds: float | None) -> str:
    """The end-of-run note on how long the last checkpoint took to save, beside the grace
    period a preempted run has for it ("" when nothing was saved)."""
    if seconds is None:
        return ""
    grace = grace_seconds()
    limit = f" (torchrun's grace period: {grace:.0f} s)" if grace is not None else ""
    return f"\nthe last checkpoint took {seconds:.2f} s to save{limit}"


def slow_save_warning(save_s: float, grace_s: float | None) -> str | None:
    """A warning when a checkpoint took longer than the grace period a stop signal leaves: the
    stop save of this run would be killed before it completes (the previous one is kept)."""
    if grace_s is None or save_s <= grace_s:
        return None
    return (
        f"warning: the last checkpoint took {save_s:.1f} s, longer than torchrun's {grace_s:.0f} s "
        "between SIGTERM and SIGKILL: a preempted run would lose the steps since its previous "
        f"checkpoint (raise it: export {TORCHRUN_GRACE_ENV}=<seconds> before torchrun, or pass "
        "--shutdown-timeout; SLURM: --signal=TERM@<seconds>; see README, Preemption)"
    )


ENV = "LLAMA_DDP_FAULT"
POINTS = ("after-step", "before-save", "after-save")
_SPEC = re.compile(
    rf"(?P<point>{'|'.join(POINTS)}):(?P<step>\d+|any)(:sleep=(?P<sleep>\d+(\.\d+)?))?"
)


@dataclass(frozen=True)
class FaultInjector:
    point: str
    step: int | None  # None: every step
    marker_dir: Path
    sleep: float = 0.0

    @classmethod
    def from_env(cls, out_dir: str | Path) -> FaultInjector | None:
        """The hook the environment asks for on this process (rank 0 only), else None."""
        spec = os.environ.get(ENV)
        if not spec or os.environ.get("RANK", "0") != "0":
            return None
        match = _SPEC.fullmatch(spec)
        if match is None or match["sleep"] is not None and float(match["sleep"]) <= 0:
            raise UserError(
                f"{ENV}={spec} is not a fault (give <point>:<step>[:sleep=<seconds>], the point "
                f"one of {', '.join(POINTS)}, the step a number or any)"
            )
        step = None if match["step"] == "any" else int(match["step"])
        return cls(match["point"], step, Path(out_dir), float(match["sleep"] or 0))

    def __call__(self, point: str, step: int) -> None:
        if point != self.point or self.step not in (None, step):
            return
        if self.sleep:
            time.sleep(self.sleep)
            return
        marker = self.marker_dir / f".fault-{point}-{step}"
        if not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
