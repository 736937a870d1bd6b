"""How fast a run trains and where its time and memory went: tokens/s, MFU against the device's
peak (a table of GPUs, measured on a CPU), where a run's time goes (training steps, evaluation,
checkpoints, waiting for data), and the profiler.

Where a run's time and memory went, for anyone: ``--profile-steps A:B`` records optimizer steps
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
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from llama_ddp.errors import UserError

# Dense peak TFLOP/s per GPU: bf16/fp16 tensor cores, TF32 tensor cores (None: the GPU has none),
# fp32 without TF32; from vendor sheets (their sparse figures halved). Matched by substring of
# torch.cuda.get_device_name(); the first match wins, so a name that contains another (H100 NVL /
# H100, L40S / L40 / L4) comes before it.
GPU_PEAK_TFLOPS: list[tuple[str, float, float | None, float]] = [
    ("GH200", 989.0, 494.7, 67.0),
    ("H200 NVL", 835.0, 417.5, 60.0),
    ("H200", 989.0, 494.7, 67.0),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100", 989.0, 494.7, 67.0),
    ("H800", 989.0, 494.7, 67.0),
    ("B200", 2250.0, 1125.0, 80.0),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("A10G", 125.0, 62.5, 31.2),
    ("A10", 125.0, 62.5, 31.2),
    ("L4", 121.0, 60.0, 30.3),
    ("RTX 4090", 165.0, 82.6, 82.6),
    ("RTX 3090", 71.0, 35.6, 35.6),
    ("V100", 125.0, None, 15.7),
    ("T4", 65.0, None, 8.1),
]


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved training FLOP/s over the hardware's peak."""
    return flops_per_token * tokens_per_s / peak_flops if peak_flops > 0 else 0.0


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The GPU's dense peak for ``dtype``; fp32 matmuls on TF32 tensor cores (``tf32``, which
    precision.allow_tf32 turns on) are measured against the TF32 peak where the GPU has one."""
    for name, half, tf32_peak, single in GPU_PEAK_TFLOPS:
        if name in device_name:
            if dtype != torch.float32:
                return half * 1e12
            return (tf32_peak if tf32 and tf32_peak else single) * 1e12
    return None


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32, size: int = 1024, trials: int = 5, seconds: float = 0.1
) -> float:
    """The machine's achievable matmul FLOP/s on the CPU with this process's threads: the best of
    a few short trials, so a passing load on a shared machine does not lower the peak. The
    matrices grow from 256 up to ``size`` while the next size's product (8x the work) would take
    at most two trials' ``seconds``: a dtype the CPU emulates (fp16, bf16 without hardware
    support) is measured in about a second, not in half a minute of 1024^3 products."""
    side = min(256, size)
    while True:
        a = torch.randn(side, side, dtype=dtype)
        b = torch.randn(side, side, dtype=dtype)
        torch.mm(a, b)  # warm up
        start = time.perf_counter()
        torch.mm(a, b)
        if side * 2 > size or 8 * (time.perf_counter() - start) > 2 * seconds:
            break
        side *= 2
    best = 0.0
    for _ in range(trials):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or n < 2:
            torch.mm(a, b)
            n += 1
        best = max(best, 2 * side**3 * n / elapsed)
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> float:
    """Peak FLOP/s of one device: the user's figure, the GPU table, or a CPU measurement."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32) or 0.0
    return measure_matmul_flops(dtype)


class Peak:
    """The peak FLOP/s of all devices computing a run, the denominator of its MFU.

    A CPU's peak is measured at start-up (`measure_matmul_flops`); a busy spell then reads low.
    When the run goes faster than that reading, the peak is measured again and never kept below
    what the run achieved: MFU never exceeds 100%. A peak given with --peak-tflops is kept."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, override: float | None, devices: int
    ) -> None:
        self.dtype, self.devices = dtype, devices
        self.measured = override is None and device.type == "cpu"
        self.flops = peak_flops(device, dtype, override) * devices

    def mfu(self, flops_per_token: float, tokens_per_s: float) -> float:
        achieved = flops_per_token * tokens_per_s
        if self.measured and achieved > self.flops:
            again = measure_matmul_flops(self.dtype) * self.devices
            self.flops = max(self.flops, again, achieved)
        return min(1.0, mfu(flops_per_token, tokens_per_s, self.flops))


class Throughput:
    """Tokens/s over the steps since the last reading (a moving window, not the whole run)."""

    def __init__(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return rate

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation, checkpoints) is not training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start


# Where a run's time goes: its phases, each with the words of the run's last line.
PHASES = {
    "train_s": "training steps",
    "eval_s": "evaluation",
    "save_s": "checkpoints",
    "data_s": "waiting for data",
}


class TimeSpent:
    """The seconds of a run's loop in each of `PHASES`, summed over its resumes: ``lap(phase)``
    adds the time since the previous lap (or ``start``) to ``phase``. Waiting for data is the
    time spent getting the next batch; on a GPU, which runs behind the host, the device may
    still be computing meanwhile, and the step's own time shows where its results are read."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._mark: float | None = None
        self._started = 0.0

    def start(self) -> None:
        self._mark = self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since ``start``."""
        return time.perf_counter() - self._started

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self._mark is not None:
            self.seconds[phase] += now - self._mark
        self._mark = now

    def record(self) -> dict[str, float]:
        """The seconds so far, by phase, and their total (metrics.jsonl's ``time``)."""
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        return {**out, "total_s": round(sum(self.seconds.values()), 3)}

    def state_dict(self) -> dict[str, float]:
        return dict(self.seconds)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.seconds = {k: float(state.get(k, 0.0)) for k in PHASES}


def memory_high_water(device: torch.device) -> dict[str, int]:
    """The GPU memory high-water mark of this rank, in bytes (a metrics line's field; none off
    CUDA)."""
    if device.type != "cuda":
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device)}


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): the time a user
    waited, the interpreter's start and imports included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: its start time
    except (OSError, ValueError, IndexError):
        return None


def time_line(seconds: dict[str, float]) -> str:
    """Where the time went, in words: seconds and share of each phase (a `TimeSpent.record`).
    The total is the record's ``total_s`` (metrics.jsonl's), not the sum of the rounded phases."""
    total = seconds["total_s"]
    parts = [
        f"{words} {seconds[k]:.1f} s ({100 * seconds[k] / total if total else 0:.1f}%)"
        for k, words in PHASES.items()
    ]
    return f"where the time went ({total:.1f} s): " + ", ".join(parts)


# ----------------------------------------------------------------------------- the profiler

PROFILE_DIR = "profile"
MEMORY_ENV = "LLAMA_DDP_MEMORY_HISTORY"
SNAPSHOT = "oom-memory-snapshot.pickle"
# Allocation events the history keeps (the newest): enough for several steps of a large model.
MAX_ENTRIES = 200_000


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B`` -> (A, B), 1 <= A <= B; else a UserError (a negative step too: steps count
    from 1)."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise UserError(
            f"--profile-steps {text!r} is not A:B with 1 <= A <= B, steps counted from 1 (e.g. "
            "--profile-steps 10:12: steps 10, 11 and 12)"
        )
    return int(match[1]), int(match[2])


def check_steps(steps: tuple[int, int] | None, last: int) -> None:
    """A UserError when the profiled range starts past ``last``, the run's last step (a range
    that ends past it is traced to the run's end)."""
    if steps is not None and steps[0] > last:
        raise UserError(
            f"--profile-steps {steps[0]}:{steps[1]} starts past the run's last step {last} "
            f"(profile steps up to {last}, e.g. --profile-steps {max(1, last - 1)}:{last})"
        )


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
        self.last: int | None = None  # the last profiled step that completed
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
        self.last = step
        if step == self.steps[1]:
            self.finish(say)

    def finish(self, say: Callable[[str], None]) -> None:
        """Stop a trace still recording (a range that ends past the run's last step, a run
        stopped early) and write the steps it saw: a profiler left running at exit crashes the
        process (torch's record_function callbacks are torn down under it)."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        profiler.stop()  # waits for the device's activity of the profiled steps
        if self.last is None:  # started, but no profiled step completed
            return
        first, last = self.steps[0], self.last
        self.folder.mkdir(parents=True, exist_ok=True)
        self.written = self.folder / f"steps-{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(str(self.written))
        say(f"profile of steps {first}-{last}: {self.written} (ui.perfetto.dev)")

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
