"""Fault injection, the test hook of the fault-tolerance tests.

``LLAMA_DDP_FAULT=<point>:<step>`` makes rank 0 SIGKILL itself when the trainer reaches that point
of that step, once per run folder (a marker file records it, so a restarted job runs on);
``<point>:<step>:sleep=<seconds>`` makes rank 0 stall there instead (a slow disk, a large save),
at every such point when the step is ``any``. Points: ``after-step`` (the step's maths done, before
its log, evaluation and checkpoint), ``before-save`` (rank 0 about to write a checkpoint),
``after-save``. A spec of another form is a UserError. The environment is read once, by the
command line; the trainer receives the hook at construction and calls it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from llama_ddp.errors import UserError

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
