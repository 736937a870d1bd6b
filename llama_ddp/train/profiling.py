"""Where a run's time and memory went, for anyone: ``--profile-steps A:B`` records optimizer steps
A to B (1-based, inclusive) with torch.profiler (CPU and, on CUDA, GPU activity) into
``OUT/profile/steps-A-B.pt.trace.json``, a Chrome trace that Perfetto (ui.perfetto.dev) and
TensorBoard's profiler plugin open. On CUDA an out-of-memory error in training saves the
allocator's recorded history to ``OUT/profile/oom-memory-snapshot.pickle`` (pytorch.org/memory_viz
draws it) and says so in its one line; the history is recorded when the run profiles or
``LLAMA_DDP_MEMORY_HISTORY=1`` asks (recording costs host time at every allocation). Rank 0
alone profiles and writes (docs/performance.md shows how to read them).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from llama_ddp.errors import UserError

PROFILE_DIR = "profile"
MEMORY_ENV = "LLAMA_DDP_MEMORY_HISTORY"
SNAPSHOT = "oom-memory-snapshot.pickle"
# Allocation events the history keeps (the newest): enough for several steps of a large model.
MAX_ENTRIES = 200_000


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B`` -> (A, B), 1 <= A <= B; else a UserError."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise UserError(
            f"--profile-steps {text!r} is not A:B with 1 <= A <= B (e.g. --profile-steps 10:12: "
            "steps 10, 11 and 12)"
        )
    return int(match[1]), int(match[2])


class StepProfiler:
    """Profiles the optimizer steps ``steps`` (A, B) of a run (None: none) into
    ``out_dir/profile/``, on rank 0 (``enabled``), and records the CUDA allocator's history for
    a snapshot at an out-of-memory error (`out_of_memory`)."""

    def __init__(
        self,
        steps: tuple[int, int] | None,
        out_dir: str | Path,
        device: torch.device,
        enabled: bool,
    ) -> None:
        self.steps, self.device = steps if enabled else None, device
        self.folder = Path(out_dir) / PROFILE_DIR
        self.profiler: torch.profiler.profile | None = None
        self.written: Path | None = None  # the trace, once written
        self.history = (
            enabled
            and device.type == "cuda"
            and (steps is not None or os.environ.get(MEMORY_ENV) == "1")
        )
        if self.history:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    @contextlib.contextmanager
    def step(self, step: int, say: Callable[[str], None]) -> Iterator[None]:
        """Around optimizer step ``step``: the trace starts before the first profiled step and is
        written after the last (``say`` tells where); each profiled step is a named range."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            yield
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        with torch.profiler.record_function(f"optimizer step {step}"):
            yield
        if step == self.steps[1]:
            self.profiler.stop()  # waits for the device's activity of the profiled steps
            self.folder.mkdir(parents=True, exist_ok=True)
            self.written = self.folder / f"steps-{self.steps[0]}-{step}.pt.trace.json"
            self.profiler.export_chrome_trace(str(self.written))
            self.profiler = None
            say(f"profile of steps {self.steps[0]}-{step}: {self.written} (ui.perfetto.dev)")

    def out_of_memory(self, step: int) -> UserError:
        """The one-line error of a CUDA out-of-memory error in step ``step``, with the memory
        snapshot it saved (when the history was recorded)."""
        gib = 2**30
        peak = torch.cuda.max_memory_allocated(self.device) / gib
        total = torch.cuda.get_device_properties(self.device).total_memory / gib
        what = f"CUDA out of memory in step {step} (peak {peak:.1f} GiB allocated of {total:.1f})"
        if self.history:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.folder / SNAPSHOT))
            what += (
                f"; memory snapshot: {self.folder / SNAPSHOT} (open it at pytorch.org/memory_viz)"
            )
        else:
            what += f"; {MEMORY_ENV}=1 saves a memory snapshot at the next one"
        return UserError(
            f"{what} (lower --micro-batch-size, add --activation-checkpointing, or use --mode fsdp)"
        )
