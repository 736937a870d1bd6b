"""The training loop: train step, evaluation, fit; and ``run``, which builds a run from its config.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp import checkpoint as ckpt
from llama_ddp import distributed as D
from llama_ddp.config import LlamaConfig, TrainConfig
from llama_ddp.data import IGNORE_INDEX, Batch, TrainData, build_data
from llama_ddp.errors import NonFiniteLoss
from llama_ddp.export import MODEL_FILE, TOKENIZER_FILE, save_model
from llama_ddp.files import prepare_run_dir
from llama_ddp.hf import export_hf
from llama_ddp.layout import segment_lengths
from llama_ddp.metrics import Reporter, Throughput, mfu, peak_flops
from llama_ddp.model import LlamaForPretraining, training_flops
from llama_ddp.optim import build_optimizer, lr_at, set_lr
from llama_ddp.parallelize import build_model, gradient_sync, parallelize
from llama_ddp.precision import Precision, resolve_dtype
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


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed token loss, on the device
    tokens: int  # real target tokens of the global batch
    grad_norm: float
    stop: bool  # some rank was asked to stop
    flops: float  # the model FLOPs of the global batch (`batch_flops`)


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
    the model attends within (documents, rows' real prefixes, or whole rows). On the CPU."""
    return training_flops(config, segment_lengths(batch.x.shape, batch.real, batch.document_ids))


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
    ) -> None:
        self.cfg, self.rt, self.data = cfg, rt, data
        self.model, self.train_model, self.optimizer = model, train_model, optimizer
        self.precision = precision
        self.fault = fault or (lambda point, step: None)
        self.out_dir = Path(cfg.out_dir)
        self.total_steps = cfg.total_steps(data.sampler.steps_per_epoch)
        self.warmup = cfg.warmup(self.total_steps)
        self.state = TrainState()
        self.model_state = ckpt.ModelState(model)
        self.parts: dict[str, ckpt.Stateful] = {
            "settings": ckpt.Settings({"model_shape": model.config.to_dict(), **data.identity()}),
            "model": self.model_state,
            "optimizer": ckpt.OptimizerState(model, optimizer),
            "scaler": precision.scaler,
            "train": self.state,
            "rng": ckpt.RNGState(),
        }

    # ----------------------------------------------------------------- policies

    def should_evaluate(self, step: int) -> bool:
        return _due(self.cfg.eval_every, step) or step == self.total_steps

    def should_save(self, step: int) -> bool:
        return step > 0 and (_due(self.cfg.save_every, step) or step == self.total_steps)

    def lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(
            step, lr=c.lr, min_lr=c.min_lr, warmup_steps=self.warmup, total_steps=self.total_steps
        )

    # ----------------------------------------------------------------- files

    def resume(self) -> None:
        """Continue from the checkpoint ``--resume`` names (rank 0 decides which), if any."""
        path = ckpt.find_resume(self.out_dir, self.cfg.resume) if self.rt.is_main else None
        path = D.broadcast_object(path, self.rt)
        if path is not None:
            ckpt.load_checkpoint(Path(path), self.parts)
            if self.rt.is_main:
                print(f"resuming from {path} (step {self.state.step})", flush=True)

    def save(self) -> None:
        if self.rt.is_main:
            ckpt.save_checkpoint(
                self.out_dir, self.state.step, self.parts, keep_last=self.cfg.keep_last
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
        """One optimizer step over the global batch's micro-batches of this rank."""
        rt, dev = self.rt, self.rt.device
        targets = sum(b.targets for b in micro_batches)
        flops = sum(batch_flops(self.model.config, b) for b in micro_batches)
        counts = torch.tensor([targets, int(stop), flops], dtype=torch.float64).to(dev)
        D.all_reduce_sum(counts, rt)  # the global batch's real targets and FLOPs; any rank stopping
        # Data-parallel wrappers average gradients over ranks: scaling by world size makes a sum.
        scale = rt.world_size / counts[0]
        loss_sum = torch.zeros((), device=dev)
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            batch = batch.to(dev)
            with gradient_sync(self.train_model, i == last):
                loss = token_loss_sum(self.train_model, batch, self.precision)
                self.precision.scaler.scale(loss * scale.float()).backward()
            loss_sum += loss.detach()
            self.fault("mid-step", self.state.step + 1)
        scaler = self.precision.scaler
        scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        # Gradients are identical on every rank after the all-reduce, so ranks agree on this.
        norm, tokens, stop_votes, flops = torch.stack(
            [grad_norm.double().to(dev), *counts]
        ).tolist()
        if not math.isfinite(norm) and not scaler.is_enabled():
            saved = ckpt.list_checkpoints(self.out_dir)
            last_good = f"the last good checkpoint is {saved[-1]}" if saved else "none was saved"
            raise NonFiniteLoss(
                f"loss or gradient is not finite at step {self.state.step + 1}; {last_good}, "
                "nothing newer was written (lower --lr, or check the data)"
            )
        set_lr(self.optimizer, self.lr(self.state.step))
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, int(tokens), norm, stop_votes > 0, flops)

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
        reporter = Reporter(self.out_dir, self.total_steps, self.state.step, enabled=rt.is_main)
        peak = peak_flops(rt.device, self.precision.dtype, cfg.peak_tflops) * rt.world_size
        sampler = self.data.sampler
        reporter.info(
            f"{self.model.config.num_hidden_layers} layers, "
            f"{self.model.num_parameters() / 1e6:.1f}M parameters | mode {rt.mode} x"
            f"{rt.world_size} on {rt.device} | {len(self.data.train)} sequences of "
            f"{cfg.seq_length}, {sampler.steps_per_epoch} steps/epoch, batch {cfg.batch_size} "
            f"= {sampler.micro_batch} x {rt.world_size} x {sampler.accum_steps} accumulation | "
            f"steps {self.state.step} -> {self.total_steps}"
        )
        try:
            if self.state.step == 0 and self.should_evaluate(0):
                self._eval_and_log(reporter)  # the starting point of the validation curve
            self.model.train()
            batches = self.data.batches(self.state.step)
            throughput, window = Throughput(), []
            while self.state.step < self.total_steps:
                result = self.train_step(next(batches), bool(preemption.signum))
                self.state.step += 1
                self.state.tokens += result.tokens
                throughput.add(result.tokens)  # real targets: padding is not throughput
                window.append(result)
                reporter.advance()
                step = self.state.step
                if _due(cfg.log_every, step) or step == self.total_steps or result.stop:
                    self._log(reporter, window, throughput, peak)
                    window = []
                with throughput.paused():
                    if self.should_evaluate(step):
                        self._eval_and_log(reporter)
                    if result.stop or self.should_save(step):
                        self.save()
                        self.fault("after-save", step)
                if result.stop:
                    reporter.info(
                        f"stopped by signal at step {step}; checkpoint saved. Resume with the "
                        "same command (--resume auto is the default)."
                    )
                    return preemption.signum or signal.SIGTERM
            self.export()
            reporter.info(f"saved {self.out_dir / MODEL_FILE}")
            D.barrier(rt)  # leave together: a rank tearing down early can abort a busy peer
            return 0
        finally:
            reporter.close()

    def _log(self, reporter, window: list[StepResult], throughput, peak) -> None:
        total = torch.stack([r.loss_sum for r in window]).sum().double().reshape(1)
        D.all_reduce_sum(total, self.rt)  # the only place the loss leaves the device
        tokens = sum(r.tokens for r in window)
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
                "mfu": mfu(sum(r.flops for r in window) / tokens, tps, peak),
            }
        )

    def _eval_and_log(self, reporter: Reporter) -> None:
        val = self.evaluate()
        if val is not None:
            ppl = math.exp(min(val, 50.0))
            reporter.log({"step": self.state.step, "val_loss": val, "val_perplexity": ppl})


def build_trainer(cfg: TrainConfig, rt: D.Runtime, *, fault: FaultHook | None = None) -> Trainer:
    """data -> model -> parallelized model -> optimizer -> Trainer, for this rank."""
    if rt.is_main:
        prepare_run_dir(cfg.out_dir)
    data = build_data(cfg, rt)
    precision = Precision(resolve_dtype(cfg.dtype, rt.device), rt.device)
    model = build_model(cfg.model_config(data.vocab_size), cfg.seed, rt.device)
    train_model = parallelize(model, rt, cfg)
    optimizer = build_optimizer(
        model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2)
    )
    return Trainer(cfg, rt, data, model, train_model, optimizer, precision, fault=fault)


def run(cfg: TrainConfig, *, fault: FaultHook | None = None) -> int:
    """Train as ``cfg`` says in this process: 0 when done, else the signal that stopped it."""
    rt = D.setup(cfg.mode, cfg.device)
    try:
        with Preemption() as preemption:
            trainer = build_trainer(cfg, rt, fault=fault)
            trainer.resume()
            return trainer.fit(preemption)
    finally:
        D.teardown(rt)
