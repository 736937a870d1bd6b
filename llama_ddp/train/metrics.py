"""Everything a run reports: the progress bar, metrics.jsonl, tokens/s and MFU, and the optional
TensorBoard and Weights & Biases loggers (``--log-to``), which get the same scalars at the same
steps.

Only rank 0 reports; other ranks get a Reporter that stays quiet.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from llama_ddp.errors import UserError
from llama_ddp.files import safe_io

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

    def start(self) -> None:
        self._mark = time.perf_counter()

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


def time_line(seconds: dict[str, float]) -> str:
    """Where the time went, in words: seconds and share of each phase (a `TimeSpent.record`)."""
    total = sum(seconds[k] for k in PHASES)
    parts = [
        f"{words} {seconds[k]:.1f} s ({100 * seconds[k] / total if total else 0:.1f}%)"
        for k, words in PHASES.items()
    ]
    return f"where the time went ({total:.1f} s): " + ", ".join(parts)


METRICS_FILE = "metrics.jsonl"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (a crash mid-write) is dropped with a
    warning; damage anywhere else is an error."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            if i < len(lines) - 1:
                raise UserError(
                    f"{path} line {i + 1} is not JSON ({exc}) (repair or remove that line)"
                ) from exc
            print(f"warning: {path}: dropping its torn last line {line[:60]!r}", file=sys.stderr)
    return records


# The scalars the loggers receive: metrics.jsonl key -> TensorBoard tag / W&B key (and each
# source's validation loss, "val_loss_by_source", as val/loss/<name>).
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "val_loss": "val/loss",
    "val_perplexity": "val/perplexity",
    "save_s": "checkpoint/save_s",
}
TASK_SCALARS = ("acc", "acc_norm")  # of each task in an evaluation's "tasks": eval/<task>/<key>


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """What the loggers receive of a metrics.jsonl record: its SCALARS, each source's validation
    loss (val/loss/<name>), and of an evaluation with tasks the seconds they took (eval/tasks_s)
    and their scores."""
    values = {tag: float(record[key]) for key, tag in SCALARS.items() if key in record}
    by_source = record.get("val_loss_by_source", {})
    values |= {f"val/loss/{name}": float(loss) for name, loss in by_source.items()}
    if "tasks_s" in record:
        values["eval/tasks_s"] = float(record["tasks_s"])
    for task, scores in record.get("tasks", {}).items():
        values.update({f"eval/{task}/{k}": float(scores[k]) for k in TASK_SCALARS})
    return values


TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class Sink(Protocol):
    """A logger that gets the scalars of metrics.jsonl (`SCALARS`, by tag) at their steps."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in ``OUT/tensorboard/``. A run opened at ``start_step`` marks every later step
    as purged: TensorBoard then drops what an interrupted run logged after the checkpoint this
    one resumes from, so the curve goes on without duplicate steps (a fresh run purges all)."""

    def __init__(self, out_dir: Path, start_step: int, run_config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = start_step + 1 if start_step > 0 else 0
        self.writer = SummaryWriter(str(out_dir / TENSORBOARD_DIR), purge_step=purge)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run folder: its id is kept in ``OUT/wandb_run_id`` and a resumed run
    resumes it (``resume="allow"``). W&B's own environment applies (``WANDB_MODE=offline``,
    ``WANDB_PROJECT``, ``WANDB_DIR``, ...); its files go under ``OUT/`` unless ``WANDB_DIR`` is set.
    W&B keeps a run's steps increasing and cannot take back what it holds: steps at or below
    the last one it has (logged by an interrupted run after its checkpoint) are not sent again."""

    def __init__(self, out_dir: Path, start_step: int, run_config: dict[str, Any]) -> None:
        import wandb

        id_path = out_dir / WANDB_ID_FILE
        run_id = id_path.read_text().strip() if id_path.is_file() else None  # None: W&B picks
        where = {} if "WANDB_DIR" in os.environ else {"dir": str(out_dir)}
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "llama_ddp"),
                id=run_id,
                resume="allow",
                config=run_config,
                **where,
            )
        except wandb.errors.Error as exc:
            raise UserError(
                f"W&B could not start its run ({exc}) (run `wandb login`, or set "
                "WANDB_MODE=offline to log without network)"
            ) from exc
        safe_io.write_text(id_path, self.run.id + "\n")
        self.first_step = self.run.starting_step  # past what an online resumed run holds

    def log(self, step: int, values: dict[str, float]) -> None:
        if step >= self.first_step:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True)
class SinkKind:
    """One entry of `SINKS`: how ``--log-to NAME`` opens its logger for a run folder (at the
    step a run starts from, with the run's settings), the package it needs (also the name of
    llama_ddp's extra that installs it) and its help text."""

    open: Callable[[Path, int, dict[str, Any]], Sink]
    package: str
    help: str


# The loggers ``--log-to`` offers; a new one is a Sink class and an entry here.
SINKS: dict[str, SinkKind] = {
    "tensorboard": SinkKind(TensorBoardSink, "tensorboard", "event files in OUT/tensorboard/"),
    "wandb": SinkKind(WandbSink, "wandb", "Weights & Biases (its own environment applies)"),
}


class Reporter:
    """Rank 0's progress bar, metrics.jsonl and ``loggers`` (names of SINKS); a no-op on other
    ranks. It decides when a step is logged (``due``: every ``every`` steps and the last).

    The log stays one run: opened at ``start_step``, it keeps the records of steps up to it (the
    run being resumed logged them before its checkpoint) and drops the rest, then appends; the
    loggers do the same."""

    def __init__(
        self,
        out_dir: Path | None,
        total_steps: int,
        start_step: int,
        enabled: bool,
        *,
        every: int = 1,
        loggers: Sequence[str] = (),
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.every, self.total_steps = every, total_steps
        self.file = None
        self.bar = None
        self.kept: list[dict[str, Any]] = []  # the records of the run this one resumes
        self.sinks: list[Sink] = []
        if not enabled:
            return
        assert out_dir is not None
        self.sinks = [SINKS[name].open(out_dir, start_step, run_config or {}) for name in loggers]
        self.path = out_dir / METRICS_FILE
        with safe_io.writing(self.path, "metrics"):
            if self.path.is_file():
                self.kept = [
                    r for r in read_records(self.path) if start_step > 0 and r["step"] <= start_step
                ]
                safe_io.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.kept))
            self.file = open(self.path, "a", buffering=1)  # noqa: SIM115
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) gets a metrics line."""
        return step % self.every == 0 or step == self.total_steps

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with safe_io.writing(self.path, "metrics"):
            self.file.write(json.dumps(record) + "\n")
        values = scalars(record)
        for sink in self.sinks:
            sink.log(record["step"], values)
        if "val_loss" in record or "tasks" in record:
            self.info(_evaluation_line(record))
        elif "loss" not in record:
            return  # where the run's time went: its last line says it (run.py)
        elif "save_s" in record:
            self.info(f"step {record['step']}: checkpoint saved in {record['save_s']:.2f} s")
        elif self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                refresh=False,
            )
        else:
            self.info(
                f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
                f"mfu {100 * record['mfu']:.1f}%"
            )

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        for sink in self.sinks:
            sink.close()


def _evaluation_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}:"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f} perplexity {record['val_perplexity']:.2f}")
    if record.get("val_loss_by_source"):
        each = " ".join(f"{n} {loss:.4f}" for n, loss in record["val_loss_by_source"].items())
        parts.append(f"| {each}")
    for task, s in record.get("tasks", {}).items():
        parts.append(f"| {task} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}")
    return " ".join(parts)
