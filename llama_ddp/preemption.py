"""Preemption: SIGTERM/SIGINT ask the run for a clean stop (finish the step, checkpoint, leave)."""

from __future__ import annotations

import signal


class Preemption:
    """Records the first SIGTERM/SIGINT in ``signum``; the trainer polls it once per step."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
