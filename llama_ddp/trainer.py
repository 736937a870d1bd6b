"""The training loop: setup, train step, evaluation, fit.

One loop serves every mode. The loss of a step is the sum of token losses over the whole global
batch divided by its number of real (non-PAD) target tokens, counted across micro-batches and
ranks, so a single process, gradient accumulation, DataParallel and DDP compute the same gradient.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from llama_ddp import checkpoint as ckpt
from llama_ddp import distributed as D
from llama_ddp.config import LlamaConfig, TrainConfig, preset
from llama_ddp.corpus import Corpus, default_cache_dir, load_splits
from llama_ddp.data import IGNORE_INDEX, GlobalBatchSampler, build_datasets, make_loader
from llama_ddp.errors import UserError
from llama_ddp.hf import export_hf
from llama_ddp.metrics import Reporter, Throughput, mfu, peak_flops
from llama_ddp.model import LlamaForPretraining, flops_per_token
from llama_ddp.optim import build_optimizer, default_warmup, lr_at, set_lr
from llama_ddp.tokenizer import (
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)

TOKENIZER_TRAIN_DOCS = 200_000  # enough text for a BPE vocabulary; bounds time on huge corpora


class NonFiniteLoss(RuntimeError):
    pass


def prepare_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--out-dir {out} is not writable ({exc.strerror}; choose another)"
        ) from exc
    return out


def resolve_tokenizer(cfg: TrainConfig, corpus: Corpus, cache_dir: Path, rt: D.Runtime):
    """The tokenizer and its file: the given one, or (``auto``) one trained on this corpus and
    cached by the corpus fingerprint and vocabulary size."""
    if cfg.tokenizer != "auto":
        return load_tokenizer(cfg.tokenizer), Path(cfg.tokenizer)
    key = hashlib.sha256(f"{corpus.fingerprint}/{cfg.vocab_size}".encode()).hexdigest()[:16]
    path = cache_dir / f"tokenizer-{key}.json"
    if rt.local_rank == 0 and not path.is_file():  # one per machine: caches are per machine
        print(f"training a {cfg.vocab_size}-token tokenizer on the corpus -> {path}", flush=True)
        texts = itertools.islice(corpus.train, TOKENIZER_TRAIN_DOCS)
        save_tokenizer(train_tokenizer(texts, cfg.vocab_size), path)
    D.barrier(rt)
    return load_tokenizer(path), path


def micro_batch_size(cfg: TrainConfig, world: int) -> int:
    micro = cfg.micro_batch_size or cfg.batch_size // world
    if micro == 0 or cfg.batch_size % (micro * world):
        raise UserError(
            f"--batch-size {cfg.batch_size} is not a multiple of --micro-batch-size {micro} x "
            f"{world} process(es) (choose a global batch divisible by micro batch x world size)"
        )
    return micro


def step_batches(loader, sampler: GlobalBatchSampler, start_step: int) -> Iterator[list]:
    """Each optimizer step's micro-batches from ``start_step`` on, cycling epochs; the position
    is index arithmetic, so a resumed run skips consumed batches without reading them."""
    epoch, pos = divmod(start_step, sampler.steps_per_epoch)
    while True:
        sampler.load_state_dict({"epoch": epoch, "step": pos})
        it = iter(loader)
        for _ in range(sampler.steps_per_epoch - pos):
            yield [next(it) for _ in range(sampler.accum_steps)]
        epoch, pos = epoch + 1, 0


def token_loss_sum(
    model, x: torch.Tensor, y: torch.Tensor, autocast, *, padded: bool = False
) -> torch.Tensor:
    """Summed next-token loss of the real targets. ``padded`` (pad mode's right-padded rows):
    the model computes the real positions only (``real=``), so padding costs no per-token work."""
    with autocast:
        if padded:
            real = y != IGNORE_INDEX
            logits, y = model(x, real=real), y[real]
        else:
            logits, y = model(x).flatten(0, 1), y.flatten()
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


class Trainer:
    def __init__(self, cfg: TrainConfig, rt: D.Runtime) -> None:
        self.cfg, self.rt = cfg, rt
        self.out_dir = prepare_out_dir(cfg.out_dir) if rt.is_main else Path(cfg.out_dir)
        cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        corpus = load_splits(
            cfg.dataset,
            config=cfg.dataset_config,
            split=cfg.split,
            text_column=cfg.text_column,
            streaming=cfg.streaming,
            val_fraction=cfg.val_fraction,
            cache_dir=cache_dir,
        )
        tok, self.tokenizer_path = resolve_tokenizer(cfg, corpus, cache_dir, rt)
        self.tokenizer_fp = tokenizer_fingerprint(tok)
        self.model_config = preset(
            cfg.preset, vocab_size=tok.get_vocab_size(), **cfg.model_overrides()
        )
        if cfg.seq_length > self.model_config.max_position_embeddings:
            raise UserError(
                f"--seq-length {cfg.seq_length} exceeds the model's max_position_embeddings "
                f"{self.model_config.max_position_embeddings} (lower --seq-length or raise "
                "--max-position-embeddings)"
            )
        self.micro = micro_batch_size(cfg, rt.world_size)
        self.padded = cfg.packing == "pad"  # right-padded rows: compute the real positions only
        self.train_ds, self.val_ds = build_datasets(
            corpus,
            tok,
            seq_length=cfg.seq_length,
            packing=cfg.packing,
            cache_dir=cache_dir,
            is_main=rt.local_rank == 0,  # caches are per machine
            barrier=lambda: D.barrier(rt),
        )
        self.sampler = GlobalBatchSampler(
            len(self.train_ds),
            global_batch=cfg.batch_size,
            micro_batch=self.micro,
            rank=rt.rank,
            world_size=rt.world_size,
            seed=cfg.seed,
        )
        pin = rt.device.type == "cuda"
        self.loader = make_loader(
            self.train_ds, self.sampler, num_workers=cfg.num_workers, pin_memory=pin
        )
        self.total_steps = cfg.max_steps or cfg.epochs * self.sampler.steps_per_epoch
        self.warmup = (
            cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(self.total_steps)
        )
        self.dtype = D.resolve_dtype(cfg.dtype, rt.device)
        self.autocast = torch.autocast(
            rt.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.dtype == torch.float16)

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and in every mode
        self.model = LlamaForPretraining(self.model_config).to(rt.device)
        self.optimizer = build_optimizer(
            self.model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2)
        )
        self.step = self._resume()
        compiled = torch.compile(self.model) if cfg.compile else self.model
        self.train_model = D.wrap(compiled, rt)

    # ----------------------------------------------------------------- checkpoints

    def _run_state(self) -> dict:
        epoch, pos = divmod(self.step, self.sampler.steps_per_epoch)
        return {
            "step": self.step,
            "epoch": epoch,
            "sampler": {"epoch": epoch, "step": pos},
            "model_config": self.model_config.to_dict(),
            "train_config": asdict(self.cfg),
            "tokenizer_fingerprint": self.tokenizer_fp,
            "world_size": self.rt.world_size,
        }

    def _resume(self) -> int:
        path = None
        if self.rt.is_main:
            path = ckpt.find_resume(self.out_dir, self.cfg.resume)
        path = D.broadcast_object(path, self.rt)
        if path is None:
            return 0
        loaded = ckpt.load_checkpoint(Path(path))
        state = loaded["state"]
        if state["tokenizer_fingerprint"] != self.tokenizer_fp:
            raise UserError(
                f"checkpoint {path} was trained with a different tokenizer (use the same "
                "--tokenizer, --resume none, or another --out-dir)"
            )
        saved = LlamaConfig.from_dict(state["model_config"])
        if saved != self.model_config:
            diff = [
                f"{k} {v} vs {getattr(self.model_config, k)}"
                for k, v in saved.to_dict().items()
                if v != getattr(self.model_config, k)
            ]
            raise UserError(
                f"checkpoint {path} has a different model shape ({', '.join(diff)}; use the "
                "same model flags, --resume none, or another --out-dir)"
            )
        self.model.load_state_dict(loaded["model"], strict=True)
        self.optimizer.load_state_dict(loaded["optimizer"])
        ckpt.set_rng_state(state["rng"], loaded["rng"])
        if self.rt.is_main:
            print(f"resuming from {path} (step {state['step']})", flush=True)
            self._truncate_metrics(state["step"])
        return int(state["step"])

    def _truncate_metrics(self, step: int) -> None:
        """Drop records a killed run logged after its last checkpoint: the log stays one run."""
        path = self.out_dir / "metrics.jsonl"
        if path.is_file():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
            path.write_text("".join(ln + "\n" for ln in kept))

    def save(self) -> None:
        if self.rt.is_main:
            ckpt.save_checkpoint(
                self.out_dir,
                self.step,
                model=self.model,
                optimizer=self.optimizer,
                state=self._run_state(),
                keep_last=self.cfg.keep_last,
            )

    def export(self) -> None:
        if self.rt.is_main:
            ckpt.save_model(self.model, self.model_config, self.out_dir, self.tokenizer_path)
            if self.cfg.export_hf:
                export_hf(self.model, self.out_dir / "hf", self.out_dir / ckpt.TOKENIZER_FILE)

    # ----------------------------------------------------------------- steps

    def train_step(
        self, micro_batches: list, stop: bool
    ) -> tuple[torch.Tensor, float, float, bool]:
        """One optimizer step. Returns (this rank's summed token loss, the global batch's real
        target tokens, grad norm, whether any rank asked to stop)."""
        rt, dev = self.rt, self.rt.device
        counts = torch.tensor(
            [sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches), int(stop)],
            dtype=torch.float64,
        ).to(dev)
        D.all_reduce_sum(counts, rt)  # real target tokens of the global batch; any rank stopping
        # DDP averages gradients over ranks; scaling by world size turns that into the sum.
        scale = rt.world_size / counts[0]
        loss_sum = torch.zeros((), device=dev)
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            sync = contextlib.nullcontext()
            if rt.distributed and i < last:
                sync = self.train_model.no_sync()  # reduce gradients once, on the last micro-step
            with sync:
                loss = token_loss_sum(self.train_model, x, y, self.autocast, padded=self.padded)
                self.scaler.scale(loss * scale.float()).backward()
            loss_sum += loss.detach()
            D.fault_point("mid-step", self.step + 1, self.out_dir)
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        # Gradients are identical on every rank after the all-reduce, so ranks agree on this.
        norm, tokens, stop_votes = torch.stack([grad_norm.double().to(dev), *counts]).tolist()
        if not math.isfinite(norm) and not self.scaler.is_enabled():
            raise NonFiniteLoss(f"loss or gradient is not finite at step {self.step + 1}")
        set_lr(self.optimizer, self._lr(self.step))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, tokens, norm, stop_votes > 0

    def _lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(
            step, lr=c.lr, min_lr=c.min_lr, warmup_steps=self.warmup, total_steps=self.total_steps
        )

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the first ``eval_batches`` validation batches (all ranks)."""
        per_rank = min(self.micro, len(self.val_ds) // self.rt.world_size)
        if per_rank == 0:
            return None
        sampler = GlobalBatchSampler(
            len(self.val_ds),
            global_batch=per_rank * self.rt.world_size,
            micro_batch=per_rank,
            rank=self.rt.rank,
            world_size=self.rt.world_size,
            shuffle=False,
        )
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        loader = make_loader(self.val_ds, sampler)
        for i, (x, y) in enumerate(loader):
            if i == self.cfg.eval_batches:
                break
            x, y = x.to(self.rt.device), y.to(self.rt.device)
            loss = token_loss_sum(self.model, x, y, self.autocast, padded=self.padded)
            totals[0] += loss.double()
            totals[1] += (y != IGNORE_INDEX).sum()
        self.model.train()
        D.all_reduce_sum(totals, self.rt)
        return (totals[0] / totals[1]).item() if totals[1] > 0 else None

    # ----------------------------------------------------------------- the loop

    def fit(self, preemption: D.Preemption) -> int:
        cfg, rt = self.cfg, self.rt
        reporter = Reporter(self.out_dir, self.total_steps, self.step, enabled=rt.is_main)
        fpt = flops_per_token(self.model_config, cfg.seq_length)
        peak = peak_flops(rt.device, self.dtype, cfg.peak_tflops) * rt.world_size
        n_params = self.model.num_parameters()
        reporter.info(
            f"{self.model_config.num_hidden_layers} layers, {n_params / 1e6:.1f}M parameters | "
            f"mode {rt.mode} x{rt.world_size} on {rt.device} | {len(self.train_ds)} sequences of "
            f"{cfg.seq_length}, {self.sampler.steps_per_epoch} steps/epoch, batch {cfg.batch_size} "
            f"= {self.micro} x {rt.world_size} x {self.sampler.accum_steps} accumulation | "
            f"steps {self.step} -> {self.total_steps}"
        )
        if cfg.eval_every and self.step == 0:
            self._eval_and_log(reporter)  # the starting point of the validation curve
        self.model.train()
        batches = step_batches(self.loader, self.sampler, self.step)
        throughput, window_loss, window_tokens = Throughput(), None, 0.0
        try:
            while self.step < self.total_steps:
                loss_sum, tokens, norm, stop = self.train_step(
                    next(batches), bool(preemption.signum)
                )
                self.step += 1
                throughput.add(tokens)  # real targets: padding is not throughput
                window_loss = loss_sum if window_loss is None else window_loss + loss_sum
                window_tokens += tokens
                reporter.advance()
                if self.step % cfg.log_every == 0 or self.step == self.total_steps or stop:
                    self._log(reporter, window_loss, window_tokens, norm, throughput, fpt, peak)
                    window_loss, window_tokens = None, 0.0
                with throughput.paused():
                    if cfg.eval_every and self.step % cfg.eval_every == 0:
                        self._eval_and_log(reporter)
                    if stop or (cfg.save_every and self.step % cfg.save_every == 0):
                        self.save()
                        D.fault_point("after-save", self.step, self.out_dir)
                if stop:
                    code = 128 + (preemption.signum or signal.SIGTERM)
                    reporter.info(
                        f"stopped by signal at step {self.step}; checkpoint saved. Resume with the "
                        "same command (--resume auto is the default)."
                    )
                    return code
            if not (cfg.eval_every and self.step % cfg.eval_every == 0):
                self._eval_and_log(reporter)
            if not (cfg.save_every and self.step % cfg.save_every == 0):
                self.save()
            self.export()
            reporter.info(f"saved {self.out_dir / ckpt.MODEL_FILE}")
            D.barrier(rt)  # leave together: a rank tearing down early can abort a busy peer
            return 0
        finally:
            reporter.close()

    def _log(self, reporter, loss_sum, tokens, norm, throughput, fpt, peak) -> None:
        total = loss_sum.double().reshape(1)
        D.all_reduce_sum(total, self.rt)  # the only place the loss leaves the device
        tps = throughput.read()
        reporter.log(
            {
                "step": self.step,
                "epoch": (self.step - 1) // self.sampler.steps_per_epoch,
                "loss": total.item() / tokens,
                "lr": self._lr(self.step - 1),
                "grad_norm": norm,
                "tokens": self.step * self.cfg.batch_size * self.cfg.seq_length,
                "tokens_per_s": tps,
                "mfu": mfu(fpt, tps, peak),
            }
        )

    def _eval_and_log(self, reporter: Reporter) -> None:
        val = self.evaluate()
        if val is not None:
            ppl = math.exp(min(val, 50.0))
            reporter.log({"step": self.step, "val_loss": val, "val_perplexity": ppl})


def run(cfg: TrainConfig) -> int:
    """Train as ``cfg`` says in this process; the exit code (0, or 128 + signal when stopped)."""
    rt = D.setup(cfg.mode, cfg.device)
    try:
        with D.Preemption() as preemption:
            trainer = Trainer(cfg, rt)
            return trainer.fit(preemption)
    except NonFiniteLoss as exc:
        if rt.is_main:
            saved = ckpt.list_checkpoints(cfg.out_dir)
            last = f"the last good checkpoint is {saved[-1]}" if saved else "no checkpoint saved"
            print(
                f"error: {exc}; {last}, nothing newer was written (lower --lr, or check the data)",
                file=sys.stderr,
            )
        return 1
    finally:
        D.teardown(rt)
