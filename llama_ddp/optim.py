"""AdamW with decay / no-decay parameter groups, and the warmup + cosine learning-rate schedule.

The schedule is a pure function of the step, so a resumed run reproduces it exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warmup from 0.1 x lr at step 0 to lr at ``warmup_steps``, then cosine from lr down to
    ``min_lr`` at ``total_steps``; ``min_lr`` after that.
    """
    if step < warmup_steps:
        return lr * (0.1 + 0.9 * step / warmup_steps)
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


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
