"""AdamW with decay / no-decay parameter groups, and the learning-rate schedules.

Every schedule is a pure function of the optimizer step, so a resumed run reproduces it exactly.
All share the warmup: linear from 0.1 x lr at step 0 to lr at ``warmup_steps``. Then:
- ``cosine``: cosine from lr down to ``min_lr``, reached at ``total_steps`` (after the last step);
- ``linear``: a straight line from lr down to ``min_lr``, reached at ``total_steps``;
- ``constant``: lr to the end (``min_lr`` unused);
- ``wsd`` (warmup, stable, decay): lr held, then the last ``decay_steps`` steps decay linearly,
  the last step running at ``min_lr``. The decay's start depends on ``total_steps`` only through
  ``decay_steps``, so a run extended before its decay started keeps every lr it already used.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from llama_ddp.errors import UserError

ScheduleName = Literal["cosine", "wsd", "linear", "constant"]


def warmup_lr(step: int, lr: float, warmup_steps: int) -> float:
    """Linear from 0.1 x lr at step 0 to lr at ``warmup_steps``."""
    return lr * (0.1 + 0.9 * step / warmup_steps)


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return warmup_lr(step, lr, warmup_steps)
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def linear_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return warmup_lr(step, lr, warmup_steps)
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr - (lr - min_lr) * progress


def constant_lr(step: int, *, lr: float, warmup_steps: int) -> float:
    return warmup_lr(step, lr, warmup_steps) if step < warmup_steps else lr


def wsd_decay_start(*, warmup_steps: int, total_steps: int, decay_fraction: float) -> int:
    """The first step of the WSD decay: the last round(decay_fraction x total_steps) steps (at
    least one) decay, never before the warmup ends."""
    decay_steps = max(1, round(decay_fraction * total_steps))
    return max(warmup_steps, total_steps - decay_steps)


def wsd_lr(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    decay_fraction: float,
) -> float:
    """Warmup, lr held, then decay step k (0-based) of n runs at lr - (lr - min_lr)(k + 1)/n."""
    if step < warmup_steps:
        return warmup_lr(step, lr, warmup_steps)
    start = wsd_decay_start(
        warmup_steps=warmup_steps, total_steps=total_steps, decay_fraction=decay_fraction
    )
    if step < start:
        return lr
    if step >= total_steps - 1:
        return min_lr
    return lr - (lr - min_lr) * (step - start + 1) / (total_steps - start)


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: ScheduleName = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based) under the named schedule."""
    if schedule == "constant":
        return constant_lr(step, lr=lr, warmup_steps=warmup_steps)
    shape = dict(lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps)
    if schedule == "cosine":
        return cosine_lr(step, **shape)
    if schedule == "linear":
        return linear_lr(step, **shape)
    if schedule == "wsd":
        return wsd_lr(step, **shape, decay_fraction=decay_fraction)
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True)
class Schedule:
    """One run's learning-rate schedule: ``schedule(step)`` is the lr of optimizer step ``step``."""

    name: ScheduleName
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_fraction: float | None = None  # set for wsd only

    def __call__(self, step: int) -> float:
        wsd = {} if self.decay_fraction is None else {"decay_fraction": self.decay_fraction}
        return lr_at(
            step,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            schedule=self.name,
            **wsd,
        )

    def decay_start(self) -> int | None:
        """The first step of the WSD decay; None for the other schedules."""
        if self.decay_fraction is None:
            return None
        return wsd_decay_start(
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            decay_fraction=self.decay_fraction,
        )

    def changes(self, other: Schedule) -> str:
        """``field old -> new`` for every field ``other`` changes."""
        ours, theirs = asdict(self), asdict(other)
        return ", ".join(f"{k} {ours[k]} -> {theirs[k]}" for k in ours if ours[k] != theirs[k])


class ScheduleState:
    """The run's ``current`` schedule, kept in each checkpoint and read back on resume as
    ``saved``, so the resumed run can tell what its own schedule changes (``resume_note``)."""

    def __init__(self, current: Schedule) -> None:
        self.current = current
        self.saved: Schedule | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.current)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = Schedule(**state)


def resume_note(saved: Schedule, now: Schedule, step: int, kept: dict[int, str]) -> str | None:
    """What resuming at ``step`` (steps taken) under ``now`` means for a run trained under
    ``saved``: None when nothing changes, else a line to print. A UserError when ``saved`` is a
    WSD schedule whose decay the checkpoint already began: a new schedule would undo it. ``kept``
    maps the steps of the checkpoints at hand to their paths, to name the one to resume instead."""
    if saved == now:
        return None
    changes = saved.changes(now)
    start = saved.decay_start()
    if start is not None and step > start:
        before = [s for s in kept if s <= start]
        instead = (
            f"or resume from {kept[max(before)]}, the last checkpoint before the decay, with "
            "--resume"
            if before
            else "or start a new run: no checkpoint from before the decay is kept (next time "
            f"save one at step {start} with --save-every)"
        )
        raise UserError(
            f"the checkpoint at step {step} is inside the WSD decay that began at step {start}, "
            f"and this run changes its schedule ({changes}), which would undo the decay (resume "
            f"with the schedule it was trained with, {instead})"
        )
    if start is not None and now.name == "wsd" and now(step) == now.lr:
        return (
            f"schedule changed ({changes}): step {step} continues the stable phase at lr "
            f"{now.lr:.3g}; the decay now starts at step {now.decay_start()} (was {start})"
        )
    return (
        f"schedule changed ({changes}): step {step} runs at lr {now(step):.3g} "
        f"(the checkpoint's schedule: {saved(step):.3g})"
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (projections, embeddings) decay; vectors (norm weights, biases) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW with the article's defaults. ``fused`` None picks the fused kernel on CUDA and the
    foreach implementation elsewhere."""
    if fused is None:
        fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, weight_decay),
        lr=lr,
        betas=betas,
        eps=eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
