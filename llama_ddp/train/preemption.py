"""Preemption: SIGTERM/SIGINT ask a run to stop cleanly, and what "cleanly" means depends on
what the run is doing.

- Preparing (corpus, tokenizer, token cache, model): there is nothing to save yet, so a signal
  stops at once (`Interrupted`, exit 128 + signal), and no checkpoint is written.
- Training: the first signal is recorded; at the next step boundary every rank votes (a signal
  seen by any rank stops all), saves a checkpoint and leaves (exit 128 + signal). The save must
  fit in the grace period before the SIGKILL (`grace_seconds`, `slow_save_warning`). A repeated
  SIGTERM is ignored: schedulers and torchrun send several (`scancel`, `kill -TERM -PGID`, then
  torchrun to its workers), and each must not cost the checkpoint. A second SIGINT, a person
  pressing Ctrl-C again, aborts at once: a save in progress removes its temporary folder
  (checkpoint.py) and nothing is left half-done.
"""

from __future__ import annotations

import os
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
