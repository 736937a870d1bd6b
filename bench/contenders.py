"""The contenders of bench/bench_train.py: one optimizer step each, on the same batches.

All on the same batches of the cached corpus and from the same initial weights:
  ours          llama_ddp's own training step (Trainer.step, built by run.build_trainer: loss
                summed over tokens and normalized by the global batch's real tokens, grad
                clipping, the run's lr schedule, AdamW with parameter groups) at the run's
                --dtype (auto: train.py's choice) and --compile; in pack mode with document
                masking (train.py's default);
  ours+OPT...   the same with options: compile, eager, fused, foreach, bf16, fp32, causal (pack
                mode without document masking: plain causal windows), or an SDPA backend it is
                restricted to: flash, cudnn, efficient, math;
  transformers  LlamaForCausalLM with the same config (its default attention, sdpa), loss through
                its own ``labels=`` path, torch.optim.AdamW at its defaults, the same lr schedule
                and clipping, under ours' autocast dtype (transformers+fp32 / +bf16 to choose);
  article       bench/article_model.py: explicit (B, 1, T, T) float mask, manual softmax attention,
                repeat_interleave GQA, RoPE recomputed per forward, fp32, AdamW at its defaults.
In pack mode transformers and the article train plain causal windows (they cannot keep documents
apart), on the same windows as ours+causal.
With --packing pad, ours reads batches cut after their longest document (its loader's default,
exact under causal attention); transformers gets the same cut batches, as its own data collator
pads to the longest sequence of a batch; the article pads every sequence to seq_length, as its
PretrainingDataset does.
Also here: running one step of a contender under the profiler (which attention kernels ran).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from article_model import LlamaForPretraining as ArticleLlama
from article_model import create_attention_mask
from torch import nn

from llama_ddp.attention_plan import varlen
from llama_ddp.data.mixture import MixtureDataset, ShardedDataset
from llama_ddp.data.pipeline import item_maker, make_loader
from llama_ddp.distributed.parallelize import runtime
from llama_ddp.interop.hf import hf_config, to_hf_state_dict
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.llama import span_flops
from llama_ddp.model.loss import IGNORE_INDEX
from llama_ddp.precision import DTYPE_NAMES
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.optim import set_lr
from llama_ddp.train.run import build_trainer
from llama_ddp.train.trainer import Trainer

# ours+OPTION: SDPA backends restrict attention to that kernel (an error if it cannot run).
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
OURS_OPTIONS = ("compile", "eager", "fused", "foreach", "bf16", "fp32", "causal", *SDPA_BACKENDS)


def train_config(args: argparse.Namespace, tokenizer: str, out_dir: Path) -> TrainConfig:
    return TrainConfig.from_flags(
        preset=args.preset,
        dataset=args.dataset,
        tokenizer=tokenizer,
        max_position_embeddings=args.max_position_embeddings,
        seq_length=args.seq_length,
        packing=args.packing,
        cache_dir=str(args.cache_dir),
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size or args.batch_size,  # not auto: the batch
        max_steps=args.warmup + args.rounds * args.steps + 1,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        out_dir=str(out_dir),
        resume="none",
        export_hf=False,
        optimizer="adamw",  # every contender's optimizer: AdamW at the article's lr
        lr=1e-3,
    )


@dataclass
class Contender:
    name: str
    settings: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[list]
    train_step: Callable[[list], torch.Tensor]  # micro-batches -> the step's mean token loss
    config: LlamaConfig  # to count each batch's model FLOPs as train.py does (`span_flops`)
    setup_s: float = 0.0
    first_step_s: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    data_s: float = 0.0
    tokens: int = 0  # real target tokens of the steps taken
    flops: int = 0  # their model FLOPs: attention per document or per row, as this one attends
    rounds: list[dict] = field(default_factory=list)
    peak_bytes: int = 0
    kernels: list[str] = field(default_factory=list)
    profile: str = ""

    def step(self) -> torch.Tensor:
        start = time.perf_counter()
        micro_batches = next(self.batches)
        self.data_s += time.perf_counter() - start
        self.tokens += sum(b.targets for b in micro_batches)
        self.flops += sum(span_flops(self.config, *b.spans) for b in micro_batches)
        return self.train_step(micro_batches)


def make_ours(name: str, cfg: TrainConfig) -> tuple[Contender, Trainer]:
    options = name.split("+")[1:]
    unknown = sorted(set(options) - set(OURS_OPTIONS))
    if unknown:
        raise SystemExit(f"error: unknown option(s) {unknown} in {name} (known: {OURS_OPTIONS})")
    rt = cfg.runtime
    rt.compile = True if "compile" in options else False if "eager" in options else rt.compile
    rt.dtype = "bf16" if "bf16" in options else "fp32" if "fp32" in options else rt.dtype
    cfg.data.document_mask = "causal" not in options
    start = time.perf_counter()
    # The trainer's own builders, with this contender's optimizer choice.
    choice = "fused" in options if {"fused", "foreach"} & set(options) else None
    trainer = build_trainer(cfg, runtime("single", cfg.runtime.device), fused=choice)
    model, optimizer, precision = trainer.model, trainer.optimizer, trainer.precision
    fused = bool(optimizer.defaults.get("fused"))
    backend = next((o for o in options if o in SDPA_BACKENDS), None)

    def train_step(micro_batches: list) -> torch.Tensor:
        with sdpa_only(backend):  # from the first (compiling) step on: compile bakes it in
            result = trainer.step(micro_batches)
        return result.loss_sum / result.stats().targets  # read back, as a logged step is

    compiled, _ = cfg.compiles(trainer.rt, model.config, trainer.total_steps)
    settings = (
        f"{precision.name}, {'compiled' if compiled else 'eager'}, "
        f"{attention_kernel(cfg, trainer, backend)}, {'fused' if fused else 'foreach'} AdamW"
    )
    batches = trainer.data.batches(0)
    c = Contender(name, settings, model, optimizer, batches, train_step, model.config)
    c.setup_s = time.perf_counter() - start
    return c, trainer


def attention_kernel(cfg: TrainConfig, trainer: Trainer, backend: str | None) -> str:
    """What ``ours`` runs for attention (attention.py's choice of kernel, in words): with an
    attention plan (documents kept apart, or padded rows) one segment-attention op per layer;
    without (plain causal windows) SDPA is_causal on whole rows."""
    if cfg.data.packing == "pack" and not cfg.data.document_mask:
        return f"SDPA is_causal+GQA on whole rows{f' ({backend} only)' if backend else ''}"
    kernel, _ = varlen.choose(
        trainer.rt.device, trainer.precision.dtype, trainer.model.config.head_dim
    )
    spans = "documents" if cfg.data.packing == "pack" else "rows' real tokens"
    return {
        "varlen": f"flash varlen (cu_seqlens) on {spans}",
        "grids": f"CPU flash kernel, is_causal on {spans} bucketed into grids",
        "sdpa": f"SDPA fallback on {spans} bucketed into grids",
    }[kernel]


def sdpa_only(backend: str | None) -> contextlib.AbstractContextManager:
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend]))


def baseline_loop(
    model: nn.Module, optimizer, trainer: Trainer, loss_fn: Callable
) -> Callable[[list], torch.Tensor]:
    """The optimizer step every baseline shares: backward per micro-batch, clip, lr, step."""
    dev, clip = trainer.rt.device, trainer.grad_clip
    done = 0

    def train_step(micro_batches: list) -> torch.Tensor:
        nonlocal done
        tokens = sum(b.targets for b in micro_batches)
        total = torch.zeros((), device=dev)
        for b in micro_batches:
            x, y = b.x.to(dev, non_blocking=True), b.y.to(dev, non_blocking=True)
            loss = loss_fn(x, y, tokens, len(micro_batches))
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)
        set_lr(optimizer, trainer.schedule(done))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        return total

    return train_step


def baseline_batches(trainer: Trainer, cfg: TrainConfig, *, trim: bool) -> Iterator[list]:
    """The same global batches as ours (the same sampler), as plain causal windows in pack mode
    (every target kept); ``trim`` cuts pad-mode batches after their longest document as ours'
    loader does."""
    data = trainer.data
    train = data.train
    if data.packing == "pack":
        plain = item_maker("pack", data.seq_length, data.special.ids.pad, document_mask=False)
        train = MixtureDataset([ShardedDataset(s.split, plain) for s in train.sources])
    pin = trainer.rt.device.type == "cuda"
    padded = data.packing == "pad"
    loader = make_loader(train, data.sampler, pin_memory=pin, trim=trim, padded=padded)
    return dataclasses.replace(data, train=train, loader=loader).batches(0)


def make_transformers(name: str, trainer: Trainer, cfg: TrainConfig) -> Contender:
    import transformers

    start = time.perf_counter()
    dev = trainer.rt.device
    options = name.split("+")[1:]
    if set(options) - {"fp32", "bf16"}:
        raise SystemExit(f"error: {name}: transformers takes only +fp32 or +bf16")
    dtype = (
        {"fp32": torch.float32, "bf16": torch.bfloat16}[options[0]]
        if options
        else trainer.precision.dtype
    )
    autocast = torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_config(trainer.model.config))
    )
    model.load_state_dict(to_hf_state_dict(trainer.model.state_dict()), strict=True)
    model.to(dev).train()
    opt = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay
    )

    def loss_fn(x, y, tokens, _accum) -> torch.Tensor:
        with autocast:  # its loss upcasts the logits to fp32 itself
            return model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=tokens).loss

    attn = model.config._attn_implementation
    settings = (
        f"{DTYPE_NAMES[dtype]}, eager, attn {attn}, AdamW defaults, "
        f"transformers {transformers.__version__}"
    )
    step = baseline_loop(model, optimizer, trainer, loss_fn)
    batches = baseline_batches(trainer, cfg, trim=True)  # its collator pads to the longest
    c = Contender(name, settings, model, optimizer, batches, step, trainer.model.config)
    c.setup_s = time.perf_counter() - start
    return c


def make_article(trainer: Trainer, cfg: TrainConfig, pad_id: int) -> Contender:
    start = time.perf_counter()
    dev = trainer.rt.device
    model = ArticleLlama(trainer.model.config)
    state = {k: v for k, v in trainer.model.state_dict().items() if "rotary_emb" not in k}
    model.load_state_dict(state, strict=True)
    model.to(dev).train()
    opt = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay
    )
    vocab = trainer.model.config.vocab_size

    def loss_fn(x, y, _tokens, accum) -> torch.Tensor:
        logits = model(x, create_attention_mask(x, pad_id))
        loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=IGNORE_INDEX)
        return loss / accum  # the tutorial's mean per micro-batch

    settings = "fp32, eager, float mask + manual softmax, repeat_interleave, AdamW defaults"
    step = baseline_loop(model, optimizer, trainer, loss_fn)
    batches = baseline_batches(trainer, cfg, trim=False)  # PretrainingDataset: seq_length
    c = Contender("article", settings, model, optimizer, batches, step, trainer.model.config)
    c.setup_s = time.perf_counter() - start
    return c


def resident_bytes(c: Contender) -> int:
    """Parameters, buffers and optimizer state of one contender on the GPU."""
    tensors = [*c.model.parameters(), *c.model.buffers()]
    tensors += [v for s in c.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)


# Profiler names that tell which attention ran: aten ops, and CUDA kernels.
ATEN_ATTENTION = ("scaled_dot_product", "attention", "_softmax")
CUDA_ATTENTION = ("flash", "fmha", "attention", "cudnn")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(c: Contender, device: torch.device, top: int) -> torch.Tensor:
    """One profiled step; records the attention kernels it ran (aten ops and, on CUDA, device
    kernels) and, when top > 0, a table of its ``top`` most expensive ops. Returns its loss."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with quiet_stderr(), torch.profiler.profile(activities=activities) as prof:
        loss = c.step()
        sync(device)
    events = prof.key_averages()
    kernels = set()
    for e in events:
        name = e.key.lower()
        if e.key.startswith("aten::"):
            hit = "log_softmax" not in name and any(s in name for s in ATEN_ATTENTION)
        else:
            hit = e.device_type == torch.autograd.DeviceType.CUDA and any(
                s in name for s in CUDA_ATTENTION
            )
        if hit:
            kernels.add(e.key[:100])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    c.kernels = sorted(kernels)
    c.profile = events.table(sort_by=sort, row_limit=top) if top else ""
    return loss


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start/stop lines, which its C++ side writes straight to fd 2."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
