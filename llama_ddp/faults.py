"""Fault injection, the test hook of the fault-tolerance tests.

``LLAMA_DDP_FAULT=<point>:<step>`` makes rank 0 SIGKILL itself when the trainer reaches that point
of that step, once per run folder (a marker file records it, so a restarted job runs on). Points:
``mid-step`` (after the first backward of the step), ``after-save``. The environment is read once,
by the command line; the trainer receives the hook at construction and calls it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ENV = "LLAMA_DDP_FAULT"


@dataclass(frozen=True)
class FaultInjector:
    point: str
    step: int
    marker_dir: Path

    @classmethod
    def from_env(cls, out_dir: str | Path) -> FaultInjector | None:
        """The hook the environment asks for on this process (rank 0 only), else None."""
        spec = os.environ.get(ENV)
        if not spec or os.environ.get("RANK", "0") != "0":
            return None
        point, _, step = spec.partition(":")
        return cls(point, int(step), Path(out_dir))

    def __call__(self, point: str, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        marker = self.marker_dir / f".fault-{point}-{step}"
        if not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
