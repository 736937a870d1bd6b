"""The training loop: one optimizer step (`Trainer.step`) and the loop over them (`Trainer.fit`).

One loop serves every mode. The loss of a step is the sum of token losses over the whole global
batch divided by its number of real (non-PAD) target tokens, counted across micro-batches and
ranks, so a single process, gradient accumulation, DataParallel and DDP compute the same gradient.
The loop knows no mode and no file: the model to train comes from parallelize.py and batches from
data/pipeline.py; at each step boundary it hands over to the components that own their "when": the
Reporter logs (metrics.py), the Evaluator scores (validation.py), the Checkpointer saves
(checkpoint/manager.py), a time budget plans the run's length (budget/budget.py). run.py builds
them all.
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llama_ddp.checkpoint.manager import Checkpointer
from llama_ddp.data.batch import Prefetcher
from llama_ddp.data.pipeline import Batch, TrainData
from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import gradient_sync, zero_grad
from llama_ddp.errors import Interrupted, NonFiniteLoss, UserError
from llama_ddp.model.llama import LlamaForPretraining, span_flops
from llama_ddp.model.loss import batch_loss_sum
from llama_ddp.precision import MAX_SKIPPED_STEPS, Precision
from llama_ddp.train.budget.budget import Budget
from llama_ddp.train.metrics import Reporter
from llama_ddp.train.optim import ScheduleState, set_lr
from llama_ddp.train.preemption import Preemption, grace_seconds, slow_save_warning
from llama_ddp.train.speed import (
    Peak,
    StepProfiler,
    Throughput,
    TimeSpent,
    memory_high_water,
    process_age,
)
from llama_ddp.train.validation import Evaluator

FaultHook = Callable[[str, int], None]
CPU = torch.device("cpu")


@dataclass
class TrainState:
    """The loop's own progress. ``step`` is also the data position: the sampler derives which
    batch comes next from it by index arithmetic, at any world size."""

    step: int = 0
    tokens: int = 0  # real target tokens trained on
    source_tokens: dict[str, int] = field(default_factory=dict)  # of each source, mixtures only
    time: TimeSpent = field(default_factory=TimeSpent)  # where the loop's seconds went
    budget: Budget | None = None  # --time-budget's: its seconds spent are kept here

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "source_tokens": self.source_tokens,
            "seconds": self.time.state_dict(),
            **(self.budget.state_dict() if self.budget is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.source_tokens = dict(state.get("source_tokens", {}))
        self.time.load_state_dict(state.get("seconds", {}))
        if self.budget is not None:
            self.budget.load_state_dict(state)


class HostCopy:
    """A small device tensor's values on the host, read later without stalling the device: a
    non-blocking copy into pinned memory and a CUDA event, so reading waits for that copy only,
    never for work queued after it. On the CPU the values are there at once."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t.detach().clone()

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().tolist()


@dataclass(frozen=True)
class StepStats:
    """What the host learns of one optimizer step."""

    targets: int  # real target tokens of the global batch (the loss's denominator)
    flops: float  # the global batch's model FLOPs (MFU's numerator)
    grad_norm: float  # before clipping; not finite: the step diverged (or fp16 skipped it)


class StepResult:
    """One optimizer step as queued on the device. ``loss_sum`` (this rank's summed token loss)
    stays there: the log adds up a window of them at once. ``stats()`` brings the step's
    `StepStats` to the host, waiting for that copy only, never for later work."""

    def __init__(self, loss_sum: torch.Tensor, stats: torch.Tensor) -> None:
        self.loss_sum = loss_sum
        self._copy = HostCopy(stats)
        self._stats: StepStats | None = None

    def stats(self) -> StepStats:
        if self._stats is None:
            targets, flops, grad_norm = self._copy.values()
            self._stats = StepStats(int(targets), flops, grad_norm)
        return self._stats


def no_fault(point: str, step: int) -> None:
    return None


@dataclass
class Trainer:
    """One run's step and loop over the pieces run.py built."""

    rt: D.Runtime
    data: TrainData
    model: LlamaForPretraining  # the weights: saving, evaluation and export read this one
    train_model: nn.Module  # what forward and backward run through (parallelize.py)
    optimizer: torch.optim.Optimizer
    precision: Precision
    schedule: ScheduleState
    checkpointer: Checkpointer
    evaluator: Evaluator
    grad_clip: float = 1.0  # 0: no clipping
    peak_tflops: float | None = None  # one device's, for MFU (None: metrics.peak_flops)
    state: TrainState = field(default_factory=TrainState)
    fault: FaultHook = no_fault  # the fault-injection test hook (preemption.py)
    skipped: int = 0  # consecutive steps whose gradients were not finite (fp16 skips them)
    last_save_s: float | None = None
    # --profile-steps, and the memory snapshot at a CUDA out-of-memory error
    profiler: StepProfiler = field(default_factory=lambda: StepProfiler(None, ".", CPU, False))
    micro_batch_note: str | None = None  # --micro-batch-size auto's choice, for the banner
    compile_note: str = ""  # whether the layers compiled and why (compile_plan.py), likewise

    @property
    def total_steps(self) -> int:
        """The run's length: its schedule's (a time budget's plan moves it)."""
        return self.schedule.current.total_steps

    # ----------------------------------------------------------------- one step

    def step(self, micro_batches: list[Batch]) -> StepResult:
        """Optimizer step ``state.step + 1`` over this rank's micro-batches of the global batch.
        Nothing in it waits for the device: its results are read later (`StepResult.stats`)."""
        rt, dev = self.rt, self.rt.device
        flops = sum(span_flops(self.model.config, *b.spans) for b in micro_batches)
        counts = torch.tensor(
            [sum(b.targets for b in micro_batches), flops],
            dtype=torch.float64,
            pin_memory=dev.type == "cuda",
        ).to(dev, non_blocking=True)
        D.all_reduce_sum(counts, rt)  # the global batch's real targets and FLOPs
        # Data-parallel wrappers average gradients over ranks: scaling by world size makes a sum.
        scale = (rt.world_size / counts[0]).float()
        loss_sum = torch.zeros((), device=dev)
        scaler, last = self.precision.scaler, len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            # The batch and its attention plan, non-blocking from pinned memory, before the
            # wrapper is called: nothing of it is copied, planned or read back in the forward.
            batch = batch.to(dev)
            with gradient_sync(self.train_model, i == last):
                loss = batch_loss_sum(self.train_model, batch, self.precision)
                scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
        scaler.unscale_(self.optimizer)
        clip = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm is a DTensor
            grad_norm = grad_norm.full_tensor()
        set_lr(self.optimizer, self.schedule(self.state.step))
        scaler.step(self.optimizer)
        scaler.update()
        zero_grad(self.train_model, self.optimizer)  # in place under DDP: its buckets
        self.state.step += 1
        # Gradients are identical on every rank after the all-reduce, so ranks agree on these.
        stats = torch.cat((counts, grad_norm.detach().double().reshape(1).to(dev)))
        return StepResult(loss_sum, stats)

    def check_start(self, checkpoint: Path, max_steps: int | None) -> None:
        """A UserError when the checkpoint resumed (at ``state.step``) is past the run's last
        step: it would "train" from step 6 to 3."""
        if self.state.step > self.total_steps:
            end = f"--max-steps {max_steps}" if max_steps else f"--epochs' {self.total_steps}"
            raise UserError(
                f"the checkpoint {checkpoint} is at step {self.state.step}, past {end} (give a "
                "larger --max-steps, or a new --out-dir to start a new run)"
            )

    # ----------------------------------------------------------------- the loop

    def fit(self, reporter: Reporter, preemption: Preemption) -> int:
        """Train to the last step: 0, or the signal that stopped the run early (every rank
        stopped after the same step, whose checkpoint was saved first)."""
        peak = Peak(self.rt.device, self.precision.dtype, self.peak_tflops, self.rt.num_devices)
        clock, start_step = self.state.time, self.state.step
        clock.start()
        if self.state.step == 0 and self.evaluator.due(0, last=False):
            self._evaluate(reporter)  # the starting point of the validation curve
        self.model.train()
        # The next step's batch is sampled, planned and copied while this step runs.
        batches = Prefetcher(self.data.batches(self.state.step), self.rt.device)
        with contextlib.closing(batches):
            try:
                return self._loop(reporter, preemption, batches, peak, start_step)
            except Interrupted:  # at once, but never with a checkpoint's writer running
                self.checkpointer.abandon()
                self._saved(reporter, leaving=True)  # the lines of the checkpoints complete
                raise
            except Exception as exc:
                self.checkpointer.close()  # a failed run's checkpoint in flight still completes
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise self.profiler.out_of_memory(self.state.step + 1) from exc
                raise
            finally:  # a range past the last step, or a run stopped early: the steps it saw
                self.profiler.finish(reporter.info)

    def _loop(
        self,
        reporter: Reporter,
        preemption: Preemption,
        batches: Prefetcher,
        peak: Peak,
        start_step: int,
    ) -> int:
        """`fit`'s steps, from the first batch on."""
        clock = self.state.time
        throughput, window, in_flight = Throughput(), [], []
        save_owed = False  # a save postponed while fp16 skipped steps
        while self.state.step < self.total_steps:
            micro_batches = next(batches)
            clock.lap("data_s")
            with self.profiler.step(self.state.step + 1, reporter.info):
                result = self.step(micro_batches)
            step = self.state.step
            self.data.count_source_targets(step, self.state.source_tokens)
            self.fault("after-step", step)
            in_flight.append(result)
            window.append(result)
            reporter.advance()
            budget = self.state.budget  # a time budget's plan: rank 0's, on every rank
            if budget and (plan := budget.after_step(step, self.schedule.current)):
                self.schedule.current = plan.schedule
                reporter.set_total(self.total_steps)
                reporter.info(plan.line)
            last = step == self.total_steps
            # Stop at the first boundary after any rank's signal: a host-side vote, no device wait.
            stop = D.any_rank(preemption.signum != 0, self.rt)
            log = reporter.due(step) or stop
            evaluate = self.evaluator.due(step, last) and not stop
            save = stop or save_owed or self.checkpointer.due(step, last)
            first = step == start_step + 1  # its end is timed: compiling, warming up
            # Read back the previous step's results while this one runs on the device; at a
            # step that logs, evaluates or saves, read back everything first.
            self._read(in_flight, keep=0 if (log or evaluate or save or first) else 1)
            if first:
                age = process_age()
                since = {} if age is None else {"process_s": round(age, 3)}
                reporter.log({"step": step, "first_step_s": round(clock.elapsed(), 3), **since})
                self.checkpointer.prepare()  # the first save's host buffers, made meanwhile
            if save and self.skipped and not (stop or last):
                save, save_owed = False, True  # no checkpoint of a state fp16 is skipping
            if log:
                self._log(reporter, window, throughput, peak)
            clock.lap("train_s")
            with throughput.paused():
                if evaluate:
                    self._evaluate(reporter)
                if save:
                    self.fault("before-save", step)
                    self.checkpointer.save(step)  # written in the background
                    if stop or last:  # the process leaves next: the write must be complete
                        self.checkpointer.wait()
                    clock.lap("save_s")
                    save_owed = False
                with preemption.deferred():  # every complete checkpoint gets its line
                    self._saved(reporter)
            if stop:
                reporter.info(
                    f"stopped by signal at step {step}; checkpoint saved. Resume with the "
                    "same command (--resume auto is the default)."
                )
                return preemption.signum or signal.SIGTERM
        if self.state.step > start_step:  # the run's time, in metrics.jsonl (run.py prints it)
            reporter.log({"step": self.state.step, "time": clock.record()})
        return 0

    def _read(self, in_flight: list[StepResult], keep: int) -> None:
        """Read back all but the newest ``keep`` steps in flight (oldest first). A non-finite
        gradient ends the run here, before anything newer than the last good checkpoint is
        written (saves come after a full read): at once in bf16/fp32, where the optimizer
        already applied it; in fp16, whose scaler skips such steps and lowers its scale, after
        MAX_SKIPPED_STEPS in a row."""
        while len(in_flight) > keep:
            stats = in_flight.pop(0).stats()
            self.state.tokens += stats.targets
            if math.isfinite(stats.grad_norm):
                self.skipped = 0
                continue
            self.skipped += 1
            if self.precision.scaler.is_enabled() and self.skipped < MAX_SKIPPED_STEPS:
                continue
            step = self.state.step - len(in_flight)
            latest = self.checkpointer.latest()
            good = f"the last good checkpoint is {latest}" if latest else "none was saved"
            streak = f" in {self.skipped} steps in a row" if self.skipped > 1 else ""
            raise NonFiniteLoss(
                f"loss or gradient is not finite{streak} at step {step}; {good}, nothing newer "
                "was written (lower --lr, or check the data)"
            )

    def _log(self, reporter: Reporter, window: list[StepResult], throughput, peak) -> None:
        """The metrics line of the steps in ``window`` (all read back), which it empties."""
        total = torch.stack([r.loss_sum for r in window]).sum().double().reshape(1)
        D.all_reduce_sum(total, self.rt)  # the only place the loss leaves the device
        stats = [r.stats() for r in window]
        window.clear()
        tokens = sum(s.targets for s in stats)
        throughput.add(tokens)  # real targets: padding is not throughput
        tps = throughput.read()
        step, sources = self.state.step, self.state.source_tokens  # sources: mixtures only
        reporter.log(
            {
                "step": step,
                "epoch": self.data.epoch(step),
                "loss": total.item() / tokens,
                "lr": self.optimizer.param_groups[0]["lr"],  # the last step's, whatever a plan did
                "grad_norm": stats[-1].grad_norm,
                "tokens": self.state.tokens,  # real targets so far, as tokens_per_s counts
                "tokens_per_s": tps,
                "mfu": peak.mfu(sum(s.flops for s in stats) / tokens, tps),
                "data_wait_s": round(self.state.time.seconds["data_s"], 3),  # so far, in all
                **memory_high_water(self.rt.device),
                **(self.state.budget.log() if self.state.budget is not None else {}),
                **({"source_tokens": dict(sources)} if sources else {}),
            }
        )

    def _evaluate(self, reporter: Reporter) -> None:
        """Score the model and log it with the time spent so far (this evaluation excluded);
        a first wait for the held-out data counts as waiting for data."""
        self.evaluator.prepare()
        self.state.time.lap("data_s")
        spent = self.state.time.record()
        record = self.evaluator.record(self.state.step)
        self.state.time.lap("eval_s")
        if self.state.budget is not None:  # what the last evaluation will take
            self.state.budget.report("eval", self.state.time.seconds["eval_s"] - spent["eval_s"])
        if record is not None:
            reporter.log({**record, "time": spent})

    def _saved(self, reporter: Reporter, leaving: bool = False) -> None:
        """Log the checkpoints completed since the last step: the seconds from the save to the
        complete folder (``save_s``, what a preempted run needs of its grace period) and the
        seconds the save kept training waiting (``save_blocked_s``); ``leaving``: that only (a
        second Ctrl-C abandoned the run)."""
        for step, seconds, blocked in self.checkpointer.completed():
            folder = self.checkpointer.folder(step).relative_to(self.checkpointer.out_dir)
            reporter.log(
                {
                    "step": step,
                    "checkpoint": str(folder),
                    "save_s": round(seconds, 3),
                    "save_blocked_s": round(blocked, 3),
                }
            )
            if leaving:
                continue
            if self.state.budget is not None:
                self.state.budget.report("save", seconds)
            grace = grace_seconds()
            warning = slow_save_warning(seconds, grace)
            if warning and slow_save_warning(self.last_save_s or 0.0, grace) is None:
                reporter.info(warning)  # once, when saves become too slow for the grace period
            self.last_save_s = seconds
