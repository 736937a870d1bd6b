"""Preemption: SIGTERM/SIGINT ask a run to stop cleanly, and what "cleanly" means depends on
what the run is doing.

- Preparing (corpus, tokenizer, token cache, model): there is nothing to save yet, so a signal
  stops at once (`Interrupted`, exit 128 + signal), and no checkpoint is written.
- Training: the first signal is recorded; the trainer finishes the step, saves a checkpoint with
  every rank, and leaves (exit 128 + signal). A repeated SIGTERM is ignored: schedulers and
  torchrun send several (`scancel`, `kill -TERM -PGID`, then torchrun to its workers), and each
  must not cost the checkpoint. A second SIGINT, a person pressing Ctrl-C again, aborts at once:
  a save in progress removes its temporary folder (checkpoint.py) and nothing is left half-done.
"""

from __future__ import annotations

import signal

from llama_ddp.errors import Interrupted


class Preemption:
    """Installs the handlers for its ``with`` block; ``training()`` ends the preparation phase,
    after which ``signum`` (polled by the trainer once per step) holds the first signal."""

    def __init__(self) -> None:
        self.signum = 0
        self.preparing = True
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def training(self) -> None:
        """Preparation is over: from now on a signal asks for a checkpoint first."""
        self.preparing = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.preparing:
            raise Interrupted(signum, "while preparing, before any training: nothing was saved")
        if not self.signum:
            self.signum = signum
        elif signum == signal.SIGINT:
            raise Interrupted(
                signum, "again: stopped at once, nothing saved since the last checkpoint"
            )
