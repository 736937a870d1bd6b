"""Muon for the decoder layers' matrices, AdamW for the rest: ``--optimizer muon`` (optim.py).

Muon (torch.optim.Muon; Keller Jordan's, https://kellerjordan.github.io/posts/muon/) updates a
hidden 2-D weight matrix with its momentum orthogonalized by a few Newton-Schulz iterations. As in
every Muon recipe, it takes only the hidden matrices (attention and MLP projections); the
embedding, the norms and the lm_head stay with AdamW. The learning rate of a Muon matrix is
adjusted by its shape as torch's ``adjust_lr_fn="match_rms_adamw"`` does (Moonshot's "Muon is
Scalable for LLM Training"): lr x 0.2 x sqrt(max(rows, cols)), which gives its update the RMS of
a typical AdamW update, so one learning rate, schedule and weight decay serve both halves.

torch.optim.Muon runs Newton-Schulz in bf16, the right choice where bf16 is native (GPUs, CPUs
with AVX512-BF16 or AMX) and ruinous where it is emulated (an AVX2 CPU multiplies bf16 ~160x
slower than fp32). `Muon` is torch's optimizer with the iteration's dtype a parameter: bf16 where
the device multiplies it natively (exactly torch's update), fp32 elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import _muon


def newton_schulz(grad: torch.Tensor, dtype: torch.dtype, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of ``grad`` (2-D), computed in
    ``dtype`` (torch's: bf16); the coefficients are torch's."""
    a, b, c = _muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its defaults, state and checkpoint format) with Newton-Schulz in
    ``ns_dtype`` (see the module docstring)."""

    def __init__(self, params: Iterable, *, ns_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """torch's `_single_tensor_muon`, the iteration in ``ns_dtype``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buf in zip(params, grads, buffers):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, self.ns_dtype, group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])  # decoupled, with the unadjusted lr
                param.add_(update, alpha=-_muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


class Optimizers:
    """Several torch optimizers stepped as one, over disjoint parameters: what the trainer, the
    gradient scaler and the learning-rate schedule see (``param_groups``, ``step``,
    ``zero_grad``); a checkpoint saves ``optimizers`` (DCP keys each state by parameter name)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: None = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def hidden_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters Muon takes: the decoder layers' 2-D weights (attention and MLP
    projections), never the embedding, the lm_head or a norm."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and ".layers." in f".{name}"
    ]
