"""The training loop: train step, evaluation, fit (the builders that make a run are in run.py).

One loop serves every mode. The loss of a step is the sum of token losses over the whole global
batch divided by its number of real (non-PAD) target tokens, counted across micro-batches and
ranks, so a single process, gradient accumulation, DataParallel and DDP compute the same gradient.
The loop knows no mode and no file format: the model to train comes from parallelize.py, batches
from data.py, saving from checkpoint.py, reporting from metrics.py.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp import checkpoint as ckpt
from llama_ddp import distributed as D
from llama_ddp.config import TrainConfig
from llama_ddp.data import IGNORE_INDEX, Batch, TrainData
from llama_ddp.errors import NonFiniteLoss
from llama_ddp.evaluate import TaskEvaluator
from llama_ddp.export import TOKENIZER_FILE, run_summary, save_model
from llama_ddp.hf import export_hf
from llama_ddp.metrics import Peak, Reporter, Throughput
from llama_ddp.model import LlamaForPretraining, span_flops
from llama_ddp.model_config import LlamaConfig
from llama_ddp.optim import Schedule, ScheduleState, resume_note, set_lr
from llama_ddp.parallelize import gradient_sync, is_sharded
from llama_ddp.precision import Precision
from llama_ddp.preemption import Preemption

FaultHook = Callable[[str, int], None]


@dataclass
class TrainState:
    """The loop's own progress. ``step`` is also the data position: the sampler derives which
    batch comes next from it by index arithmetic, at any world size."""

    step: int = 0
    tokens: int = 0  # real target tokens trained on

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


class Readback:
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


@dataclass
class StepResult:
    """One optimizer step. The device values arrive in ``readback`` (global batch's real target
    tokens, any rank's stop vote, gradient norm); ``settle`` copies them into the fields."""

    loss_sum: torch.Tensor  # this rank's summed token loss, on the device
    readback: Readback
    tokens: int = 0
    stop: bool = False
    grad_norm: float = math.nan
    flops: float = 0.0  # the model FLOPs of the global batch (`batch_flops`)


def token_loss_sum(model: nn.Module, batch: Batch, precision: Precision) -> torch.Tensor:
    """Summed next-token loss of the batch's real targets. A pad-mode batch passes its ``real``
    mask: the model computes those positions only, so padding costs no per-token work. A packed
    batch with document masking passes its ``document_ids``: each document attends alone."""
    with precision.autocast():
        logits = model(batch.x, real=batch.real, document_ids=batch.document_ids)
    logits = logits.flatten(0, -2)  # (N, V): one row per label
    return F.cross_entropy(logits.float(), batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")


def batch_flops(config: LlamaConfig, batch: Batch) -> int:
    """The model FLOPs of training on ``batch``, MFU's numerator: attention counted over the spans
    the model attends within (documents, rows' real prefixes, or whole rows), from the span
    statistics its collate function measured on the CPU."""
    return span_flops(config, *batch.spans)


def _due(every: int, step: int) -> bool:
    return every > 0 and step % every == 0


class Trainer:
    """One run's loop over the pieces the builders made (see ``run``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        rt: D.Runtime,
        data: TrainData,
        model: LlamaForPretraining,
        train_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        fault: FaultHook | None = None,
        tasks: TaskEvaluator | None = None,
    ) -> None:
        self.cfg, self.rt, self.data = cfg, rt, data
        self.tasks = tasks  # downstream tasks scored with the validation loss (evaluate.py)
        self.model, self.train_model, self.optimizer = model, train_model, optimizer
        self.precision = precision
        self.fault = fault or (lambda point, step: None)
        self.out_dir = Path(cfg.out_dir)
        self.total_steps = cfg.total_steps(data.sampler.steps_per_epoch)
        self.schedule = ScheduleState(
            Schedule(
                cfg.lr_schedule,
                cfg.lr,
                cfg.min_lr,
                cfg.warmup(self.total_steps),
                self.total_steps,
                cfg.decay_fraction if cfg.lr_schedule == "wsd" else None,
            )
        )
        self.state = TrainState()
        self.model_state = ckpt.ModelState(model)
        self.sharded = is_sharded(model)
        self.parts: dict[str, ckpt.Stateful] = {
            "settings": ckpt.Settings({"model_shape": model.config.to_dict(), **data.identity()}),
            "model": self.model_state,
            "optimizer": ckpt.OptimizerState(model, optimizer),
            "scaler": precision.scaler,
            "train": self.state,
            "schedule": self.schedule,
            "rng": ckpt.RNGState(),
        }

    # ----------------------------------------------------------------- policies

    def should_evaluate(self, step: int) -> bool:
        return _due(self.cfg.eval_every, step) or step == self.total_steps

    def should_save(self, step: int) -> bool:
        return step > 0 and (_due(self.cfg.save_every, step) or step == self.total_steps)

    def lr(self, step: int) -> float:
        return self.schedule.current(step)

    # ----------------------------------------------------------------- files

    def resume(self, path: Path | None) -> None:
        """Continue from the checkpoint at ``path`` (``run.resume_point``); None: a new run."""
        if path is None:
            if self.cfg.init_from and self.rt.is_main:
                print(f"initial weights from {self.cfg.init_from}", flush=True)
            return
        ckpt.load_checkpoint(Path(path), self.parts, rt=self.rt if self.sharded else None)
        notes = [self._continue_schedule()]
        if self.cfg.init_from:
            notes.append(f"--init-from {self.cfg.init_from} unused: the checkpoint is newer")
        if self.rt.is_main:
            print(f"resuming from {path} (step {self.state.step})", flush=True)
            for note in filter(None, notes):
                print(f"note: {note}", flush=True)

    def _continue_schedule(self) -> str | None:
        """Adopt the loaded checkpoint's warmup unless --warmup-steps is given (its default
        depends on the run's length, which a resume may change); say what else changes, or
        refuse to undo a WSD decay (``resume_note``)."""
        saved, now = self.schedule.saved, self.schedule.current
        if self.cfg.warmup_steps is None:
            now = replace(now, warmup_steps=saved.warmup_steps)
        kept = {int(p.name.split("-")[1]): str(p) for p in ckpt.list_checkpoints(self.out_dir)}
        note = resume_note(saved, now, self.state.step, kept)
        self.schedule.current = now
        return note

    def save(self) -> None:
        """A checkpoint: rank 0 writes it, or with sharded weights every rank its shards."""
        if self.rt.is_main:
            self.fault("before-save", self.state.step)
        if self.sharded or self.rt.is_main:
            ckpt.save_checkpoint(
                self.out_dir,
                self.state.step,
                self.parts,
                keep_last=self.cfg.keep_last,
                rt=self.rt if self.sharded else None,
            )

    def export(self) -> None:
        """llama_model.pth, llama_model.json, tokenizer.json and hf/ (rank 0)."""
        state = self.model_state.full_state_dict()
        if self.rt.is_main:
            save_model(state, self.model.config, self.out_dir, self.data.tokenizer_path)
            if self.cfg.export_hf:
                tokenizer = self.out_dir / TOKENIZER_FILE
                export_hf(state, self.out_dir / "hf", tokenizer, config=self.model.config)

    # ----------------------------------------------------------------- steps

    def train_step(self, micro_batches: list[Batch], stop: bool) -> StepResult:
        """One optimizer step over this rank's micro-batches of the global batch. Nothing in it
        waits for the device: its results are read back later (`settle`)."""
        rt, dev = self.rt, self.rt.device
        micro_flops = sum(batch_flops(self.model.config, b) for b in micro_batches)
        counts = torch.tensor(
            [sum(b.targets for b in micro_batches), int(stop), micro_flops],
            dtype=torch.float64,
            pin_memory=dev.type == "cuda",
        ).to(dev, non_blocking=True)
        D.all_reduce_sum(counts, rt)  # the global batch's real targets and FLOPs; any rank stopping
        # Data-parallel wrappers average gradients over ranks: scaling by world size makes a sum.
        scale = (rt.world_size / counts[0]).float()
        loss_sum = torch.zeros((), device=dev)
        scaler, last = self.precision.scaler, len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            batch = batch.to(dev)
            with gradient_sync(self.train_model, i == last):
                loss = token_loss_sum(self.train_model, batch, self.precision)
                scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
            self.fault("mid-step", self.state.step + 1)
        scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm is a DTensor
            grad_norm = grad_norm.full_tensor()
        set_lr(self.optimizer, self.lr(self.state.step))
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        # Gradients are identical on every rank after the all-reduce, so ranks agree on these.
        flags = torch.cat((counts, grad_norm.detach().double().reshape(1).to(dev)))
        return StepResult(loss_sum, Readback(flags))

    def settle(self, pending: list[tuple[int, StepResult]], keep: int) -> bool:
        """Read back the results of all but the newest ``keep`` pending steps (oldest first);
        True if any asked to stop. A non-finite gradient norm ends the run here, before anything
        newer than the last good checkpoint is written (saves only come after a full settle)."""
        stop = False
        while len(pending) > keep:
            step, result = pending.pop(0)
            tokens, votes, flops, norm = result.readback.values()
            result.tokens, result.stop, result.grad_norm = int(tokens), votes > 0, norm
            result.flops = flops
            if not math.isfinite(norm) and not self.precision.scaler.is_enabled():
                saved = ckpt.list_checkpoints(self.out_dir)
                good = f"the last good checkpoint is {saved[-1]}" if saved else "none was saved"
                raise NonFiniteLoss(
                    f"loss or gradient is not finite at step {step}; {good}, nothing newer was "
                    "written (lower --lr, or check the data)"
                )
            self.state.tokens += result.tokens
            stop = stop or result.stop
        return stop

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the first ``eval_batches`` validation batches (all ranks)."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for batch in self.data.validation_batches(self.rt, self.cfg.eval_batches):
            totals[0] += token_loss_sum(self.model, batch.to(self.rt.device), self.precision)
            totals[1] += batch.targets
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    # ----------------------------------------------------------------- the loop

    def fit(self, preemption: Preemption) -> int:
        """Train to the last step; returns 0, or the signal that stopped the run early (a
        checkpoint was saved first)."""
        cfg, rt = self.cfg, self.rt
        reporter = self._reporter()
        peak = Peak(rt.device, self.precision.dtype, cfg.peak_tflops, rt.num_devices)
        try:
            if self.state.step == 0 and self.should_evaluate(0):
                self._eval_and_log(reporter)  # the starting point of the validation curve
            self.model.train()
            batches = self.data.batches(self.state.step)
            throughput, window, pending = Throughput(), [], []
            while self.state.step < self.total_steps:
                result = self.train_step(next(batches), bool(preemption.signum))
                self.state.step += 1
                step = self.state.step
                pending.append((step, result))
                window.append(result)
                reporter.advance()
                log = _due(cfg.log_every, step) or step == self.total_steps
                # Read back the previous step's results while this one runs on the device; at a
                # step that logs, evaluates or saves, read back everything.
                boundary = log or self.should_evaluate(step) or self.should_save(step)
                stop = self.settle(pending, keep=0 if boundary else 1)
                if stop:  # this step is the last: read it back too, for the checkpoint
                    self.settle(pending, keep=0)
                if log or stop:
                    self._log(reporter, window, throughput, peak)
                    window = []
                with throughput.paused():
                    if self.should_evaluate(step):
                        self._eval_and_log(reporter)
                    if stop or self.should_save(step):
                        self.save()
                        self.fault("after-save", step)
                if stop:
                    D.barrier(rt)  # every rank waits for the checkpoint before leaving
                    reporter.info(
                        f"stopped by signal at step {step}; checkpoint saved. Resume with the "
                        "same command (--resume auto is the default)."
                    )
                    return preemption.signum or signal.SIGTERM
            self.export()
            saved = ckpt.list_checkpoints(self.out_dir)
            reporter.info(run_summary(self.out_dir, saved[-1] if saved else None, cfg.export_hf))
            D.barrier(rt)  # leave together: a rank tearing down early can abort a busy peer
            return 0
        finally:
            reporter.close()

    def _reporter(self) -> Reporter:
        """Rank 0's progress bar, metrics.jsonl and loggers, opened with what this run is."""
        cfg, rt, sampler = self.cfg, self.rt, self.data.sampler
        reporter = Reporter(
            self.out_dir,
            self.total_steps,
            self.state.step,
            enabled=rt.is_main,
            loggers=cfg.loggers(),
            run_config=asdict(cfg),
        )
        reporter.info(
            f"{self.model.config.num_hidden_layers} layers, "
            f"{self.model.num_parameters() / 1e6:.1f}M parameters | mode {rt.mode} x"
            f"{rt.world_size} on {rt.device} | {len(self.data.train)} sequences of "
            f"{cfg.seq_length}, {sampler.steps_per_epoch} steps/epoch, batch {cfg.batch_size} "
            f"= {sampler.micro_batch} x {rt.world_size} x {sampler.accum_steps} accumulation | "
            f"steps {self.state.step} -> {self.total_steps}"
        )
        reporter.info(f"special tokens: {self.data.special.describe()}")
        return reporter

    def _log(self, reporter, window: list[StepResult], throughput, peak) -> None:
        total = torch.stack([r.loss_sum for r in window]).sum().double().reshape(1)
        D.all_reduce_sum(total, self.rt)  # the only place the loss leaves the device
        tokens = sum(r.tokens for r in window)
        throughput.add(tokens)  # real targets: padding is not throughput
        tps = throughput.read()
        step = self.state.step
        reporter.log(
            {
                "step": step,
                "epoch": (step - 1) // self.data.sampler.steps_per_epoch,
                "loss": total.item() / tokens,
                "lr": self.lr(step - 1),
                "grad_norm": window[-1].grad_norm,
                "tokens": self.state.tokens,  # real targets so far, as tokens_per_s counts
                "tokens_per_s": tps,
                "mfu": peak.mfu(sum(r.flops for r in window) / tokens, tps),
                **self._memory(),
            }
        )

    def _memory(self) -> dict[str, int]:
        """The GPU memory high-water mark of this rank (rank 0 logs it), in bytes."""
        if self.rt.device.type != "cuda":
            return {}
        return {"max_memory_allocated": torch.cuda.max_memory_allocated(self.rt.device)}

    def _eval_and_log(self, reporter: Reporter) -> None:
        val = self.evaluate()
        record: dict[str, Any] = {"step": self.state.step}
        if val is not None:
            record.update(val_loss=val, val_perplexity=math.exp(min(val, 50.0)))
        if self.tasks is not None:
            record["tasks"] = self.tasks(self.model, self.rt, self.precision)
        if len(record) > 1:
            reporter.log(record)
