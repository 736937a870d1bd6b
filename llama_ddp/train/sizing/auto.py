"""--model-size auto: before training, time a few steps of candidate sizes of the model family on
this machine and this run's shape (its data, batch, mode and precision, every rank taking part),
predict what each would reach in the time left, and train the best (the rule:
train/sizing/rule.py). Under torchrun rank 0's clock and choices decide and every rank takes
them. A resumed run keeps the size its checkpoint was trained with, and times nothing.

run.py calls `choose_size` once the run's checkpoint is known, before anything of the model is
built; the data it read is handed on to the run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.data.batch import Batch, Prefetcher
from llama_ddp.data.pipeline import TrainData
from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.memory import available_memory, micro_batch_choice, wants_auto
from llama_ddp.distributed.parallelize import (
    Init,
    empty_model,
    parallelize,
    replica_mesh,
)
from llama_ddp.errors import UserError
from llama_ddp.model import family
from llama_ddp.model.config import AUTO, LlamaConfig
from llama_ddp.model.loss import batch_loss_sum
from llama_ddp.precision import Precision, training_dtype
from llama_ddp.train.budget import budget as budget_module
from llama_ddp.train.budget.budget import TIMED_STEPS
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.optim import ScheduleState, make_schedule
from llama_ddp.train.sizing.rule import MEASURE_SHARE, Candidate, Choice, Size, choose
from llama_ddp.train.speed import process_age
from llama_ddp.train.trainer import Trainer


@dataclass
class Sized:
    """The run's config with its size decided, the data read to decide it (None: none was), the
    lines that say what was chosen and why, and the choice (None: none was made)."""

    cfg: TrainConfig
    data: TrainData | None = None
    lines: list[str] = field(default_factory=list)
    choice: Choice | None = None


def with_depth(cfg: TrainConfig, depth: int) -> TrainConfig:
    return replace(cfg, model=replace(cfg.model, model_size=str(depth)))


def choose_size(
    cfg: TrainConfig,
    rt: D.Runtime,
    resume: Path | None,
    make_data: Callable[[TrainConfig], TrainData],
) -> Sized:
    """``cfg`` with --model-size auto replaced by the depth chosen (others unchanged), and the
    run's data made by ``make_data`` where candidates were timed on it."""
    if cfg.model.model_size != AUTO:
        return Sized(cfg)
    if resume is not None:
        return _kept(cfg, resume)
    smallest = with_depth(cfg, 1).model_config(cfg.data.vocab_size)  # --seq-length fits
    auto = wants_auto(cfg.data.micro_batch_size, rt.device, rt.mode)  # measured per size
    micro = 1 if auto else cfg.data.micro_batch(rt.world_size)
    smallest.check_batch_fits(micro, cfg.data.seq_length, rt.device)
    data = make_data(cfg)
    sizes = family_sizes(cfg, data.vocab_size)
    dtype, reason = training_dtype(cfg.runtime.dtype, rt.device)
    precision = Precision(dtype, rt.device, reason)
    share = functools.partial(D.broadcast_object, rt=rt)
    budget = cfg.time_budget(sizes[0].parameters, process_age())
    left = budget.left()
    if not share(left > budget.reserve(0.0)):  # no step fits: the budget's start says so
        return Sized(with_depth(cfg, 1), data)
    step_tokens = cfg.data.batch_size * cfg.data.seq_length

    def fit(size: Size, step_s: float) -> int:
        return cfg.time_budget(size.parameters, process_age()).fit(step_s)

    def measure(size: Size) -> float | None:
        return share(_time_steps(with_depth(cfg, size.depth), rt, data, precision))

    clock = budget_module.CLOCK  # the budget's (tests fake it)
    corpus = corpus_tokens(data, step_tokens)
    choice = choose(sizes, measure, fit, step_tokens, MEASURE_SHARE * left, clock, share, corpus)
    return Sized(with_depth(cfg, choice.best.depth), data, describe(choice, corpus), choice)


def family_sizes(cfg: TrainConfig, vocab_size: int) -> list[Size]:
    """Every member of the family as auto weighs it for ``cfg``'s run (its sequence length and
    tying: a tied embedding counted once)."""
    return [
        Size.of(d, vocab_size, cfg.data.seq_length, tied=cfg.model.tied())
        for d in range(1, family.MAX_DEPTH + 1)
    ]


def corpus_tokens(data: TrainData, step_tokens: int) -> int | None:
    """A pass over the run's training data in tokens (None: not known yet, its cache building)."""
    epoch = data.sampler.steps_per_epoch
    return None if epoch is None else epoch * step_tokens


def _kept(cfg: TrainConfig, resume: Path) -> Sized:
    shape = LlamaConfig.from_dict(ckpt.saved_setting(resume, "model_shape"))
    depth = shape.num_hidden_layers
    # A member is its derived fields: the shape flags auto takes (--max-position-embeddings,
    # --rope-theta, --tie-embeddings) are the run's own, checked against the checkpoint as any
    # resumed run's are
    member = family.member_shape(depth) if 1 <= depth <= family.MAX_DEPTH else {}
    if any(getattr(shape, k) != member.get(k) for k in family.DERIVED):
        raise UserError(
            f"--model-size auto: the checkpoint {resume} is of a model outside the family "
            f"({shape.num_hidden_layers} layers, hidden size {shape.hidden_size}) (resume it with "
            "the --preset or shape flags it was trained with)"
        )
    line = (
        f"model size: depth {depth} ({shape.num_parameters() / 1e6:.2f}M parameters), kept from "
        f"the checkpoint: a resumed run keeps the size auto chose (nothing timed)"
    )
    return Sized(with_depth(cfg, depth), None, [line])


def _time_steps(
    cfg: TrainConfig, rt: D.Runtime, data: TrainData, precision: Precision
) -> float | None:
    """Seconds a step of ``cfg``'s model takes here (rank 0's clock): a throwaway model,
    optimizer and schedule, built as the run builds them, one warm-up step, then the mean of
    TIMED_STEPS on the run's first batches; None, on every rank, where it does not fit a rank's
    device.

    The step is the run's: compiled where the run compiles (`TrainConfig.compiles`; the warm-up step
    pays the compile, which the run pays too), at the micro-batch and accumulation the run
    would take for this size (--micro-batch-size auto: memory.py's choice, made for each size);
    the batches one a step from the `Prefetcher`, its thread reading the next while a step
    runs, as the run's loop takes them. Read before the steps, with no other thread in the
    process, the same steps took 3-6x the run's on the CPU (6x the CPU time in every op;
    measured, the cause inside torch's thread pool not found).

    Out of memory: each rank first runs the forward and backward of its first micro-batch alone
    (`_attempt`; DDP: the unwrapped model, no collective) and the ranks vote (`D.any_rank`) before
    any step's collective, so a size one rank cannot hold is dropped by all. FSDP's attempt
    gathers weights from the other ranks: a rank out of memory there ends with its line."""
    cfg = cfg.settle()
    config = cfg.model_config(data.vocab_size)
    compiled, _ = cfg.compiles(rt, config, 0)  # a budget run's: by its seconds, as the run's
    checkpointing = cfg.runtime.activation_checkpointing
    model = empty_model(config)
    sampler, micro_batch = data.sampler, data.sampler.micro_batch
    try:
        init = Init(model, cfg.runtime.seed)
        train_model = parallelize(model, rt, precision, init, checkpointing=checkpointing,
                                  compile=compiled)  # fmt: skip
        if wants_auto(cfg.data.micro_batch_size, rt.device, rt.mode):
            try:
                chosen, _ = micro_batch_choice(rt, data, train_model, model, precision,
                                               checkpointing)  # fmt: skip
            except UserError:  # not even 1 fits, said on every rank (FSDP's: this rank's only)
                if rt.mode == "fsdp" or available_memory(rt.device)[0] is None:
                    raise
                return None
            sampler.set_micro_batch(chosen)
        with contextlib.closing(Prefetcher(data.batches(0), rt.device)) as batches:
            first = next(batches)
            alone = model if rt.mode == "ddp" else train_model
            if D.any_rank(not _attempt(alone, model, first[0].to(rt.device), precision), rt):
                return None
            mesh = replica_mesh(train_model)
            optimizer = cfg.optim.build(
                model, fused=None, dtype=precision.dtype, mesh=mesh, compiled=compiled
            )
            lr = cfg.optim.lr
            schedule = ScheduleState(make_schedule("constant", lr=lr, min_lr=lr, warmup_steps=0,
                                                   total_steps=1 + TIMED_STEPS))  # fmt: skip
            trainer = Trainer(rt, data, model, train_model, optimizer, precision, schedule, None,
                              None, grad_clip=cfg.optim.grad_clip)  # fmt: skip
            trainer.step(first).stats()  # allocations, caches, a compile: not timed
            D.barrier(rt)
            start = time.perf_counter()
            for _ in range(TIMED_STEPS):
                trainer.step(next(batches)).stats()
            return (time.perf_counter() - start) / TIMED_STEPS
    except torch.cuda.OutOfMemoryError:  # past the vote (the optimizer's states): one process
        return None
    finally:
        sampler.set_micro_batch(micro_batch)  # the run's own choice is made for its size
        del model
        gc.collect()
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()


def _attempt(alone: nn.Module, model: nn.Module, batch: Batch, precision: Precision) -> bool:
    """Whether a micro-batch's forward and backward through ``alone`` fit this rank's device
    (its gradients dropped after)."""
    try:
        batch_loss_sum(alone, batch, precision).backward()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        for p in model.parameters():
            p.grad = None
        if batch.x.is_cuda:
            torch.cuda.empty_cache()


PUBLISHED_NAME = "Besiroglu et al. 2024's re-fit of Chinchilla's law"


def prediction_said(c: Candidate) -> str:
    """A candidate's prediction as the banner says it: a val bpb inside the measured runs, one
    labelled an extrapolation within a decade of them, and beyond them no bpb, the ranking's
    basis instead (law.py: the published law's level on this corpus is not known)."""
    p = c.prediction
    if p.source == "runs":
        return f"predicted val bpb {p.bpb:.3f}"
    if p.source == "blend":
        return f"predicted val bpb {p.bpb:.3f}, extrapolated to {p.beyond()}"
    return f"ranked by {PUBLISHED_NAME} at {p.beyond()}, no bpb predicted"


def count(n: float) -> str:
    """A count of parameters or tokens in millions (billions from 10^9 on)."""
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def describe(
    choice: Choice,
    corpus: int | None,
    unknown: str = "its token cache is being built",
    stated: bool = False,
) -> list[str]:
    """The banner's lines: the size chosen, its parameters (all of them, a tied embedding once),
    tokens and tokens per parameter, the runner-up, the sizes timed (``stated``: their step
    times from a stated device's FLOPs, nothing timed) and where the prediction comes from; a
    corpus repeated (``corpus``: a pass's tokens, None: not known, as ``unknown`` says why).
    Where no candidate's step fits, one line says so and nothing is predicted."""
    best, runner = choice.best, choice.runner_up
    timed = ", ".join(
        f"d{c.depth} {c.step_s:.3f} s" for c in sorted(choice.timed, key=lambda c: c.depth)
    )
    if best.steps <= 0:
        return [
            f"model size: depth {best.depth}: no candidate's step ({timed}) fits the time left "
            f"after timing them ({choice.measuring_s:.1f} s), so nothing is predicted"
        ]

    def said(c: Candidate) -> str:
        s = c.size
        return (
            f"depth {c.depth} ({count(s.parameters)} parameters, {count(s.non_embedding)} "
            f"of them non-embedding; {count(c.tokens)} tokens in {c.steps} steps, "
            f"{c.tokens / s.parameters:.2f} tokens per parameter, "
            f"{c.tokens / s.non_embedding:.1f} per non-embedding one; {prediction_said(c)})"
        )

    source = {
        "runs": "train/sizing/law.py's fit of this project's runs (the best lies within them)",
        "blend": f"train/sizing/law.py's fit of this project's runs joined to {PUBLISHED_NAME} "
        f"(the best lies at {best.prediction.beyond()})",
        "law": f"{PUBLISHED_NAME} (train/sizing/law.py), the best lying at "
        f"{best.prediction.beyond()} of this project's runs",
    }[best.prediction.source]
    runner_up = f"; runner-up: {said(runner)}" if runner and runner.steps > 0 else ""
    how = (
        f"a step of each candidate from its FLOPs on the stated device ({timed}), nothing timed: "
        f"a run's timing of them would take {choice.measuring_s:.1f} s"
        if stated
        else f"a step timed of each candidate ({timed}) took {choice.measuring_s:.1f} s"
    )
    lines = [
        f"model size: auto chose {said(best)}{runner_up}",
        f"model size: {how} of the budget (those after the first at most {MEASURE_SHARE:.0%} of "
        f"the time left); the prediction is {source}",
    ]
    epochs = best.prediction.epochs
    if corpus is None:
        lines.append(
            f"note: the corpus's size is not known yet ({unknown}): auto counts every token as new"
        )
    elif epochs is not None and epochs > 1:
        worth = best.prediction.effective_tokens / corpus
        lines.append(
            f"note: the corpus holds {count(corpus)} tokens a pass, fewer than the "
            f"{count(best.tokens)} planned: they repeat {epochs:.1f} times, worth "
            f"{worth:.1f} passes of new tokens in auto's prediction (a repeat is worth less than "
            "new data: Muennighoff et al. 2023; docs/training.md)"
        )
    return lines
