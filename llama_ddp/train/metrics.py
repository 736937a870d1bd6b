"""Everything a run reports: the progress bar, metrics.jsonl, and the optional TensorBoard and
Weights & Biases loggers (``--log-to``), which get the same scalars at the same steps; and reading
a metrics.jsonl back (its curves: ``python -m llama_ddp.plot``, llama_ddp/plot.py). What the
numbers are (tokens/s, MFU, where the time went): speed.py.

Only rank 0 reports; other ranks get a Reporter that stays quiet.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from llama_ddp.errors import UserError
from llama_ddp.files import safe_io

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
    "val_bpb": "val/bpb",
    "save_s": "checkpoint/save_s",
    "save_blocked_s": "checkpoint/save_blocked_s",
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
                **({"left": f"{record['time_left_s']:.0f}s"} if "time_left_s" in record else {}),
                refresh=False,
            )
        else:
            self.info(
                f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
                f"mfu {100 * record['mfu']:.1f}%{_memory(record)}{_time_left(record)}"
            )

    def set_total(self, total_steps: int) -> None:
        """The run's new length (a time budget's plan)."""
        self.total_steps = total_steps
        if self.bar is not None:
            self.bar.total = total_steps

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


def _memory(record: dict[str, Any]) -> str:
    """The GPU's peak memory so far, where the record has it (CUDA)."""
    if "max_memory_allocated" not in record:
        return ""
    return f" peak memory {record['max_memory_allocated'] / 2**30:.1f} GiB"


def _time_left(record: dict[str, Any]) -> str:
    """A time budget's seconds left, where the record has them."""
    return f" time left {record['time_left_s']:.0f} s" if "time_left_s" in record else ""


def _evaluation_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}:"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f} perplexity {record['val_perplexity']:.2f}")
        if "val_bpb" in record:
            parts.append(f"bpb {record['val_bpb']:.4f}")
    if record.get("val_loss_by_source"):
        each = " ".join(f"{n} {loss:.4f}" for n, loss in record["val_loss_by_source"].items())
        parts.append(f"| {each}")
    for task, s in record.get("tasks", {}).items():
        parts.append(f"| {task} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}")
    return " ".join(parts)


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a metrics.jsonl."""
    if not path.is_file():
        raise UserError(f"{path} not found (give a run's metrics.jsonl)")
    records = read_records(path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r or "tasks" in r]
    if not train and not evals:
        raise UserError(f"{path} has no training or evaluation records yet")
    return train, evals
