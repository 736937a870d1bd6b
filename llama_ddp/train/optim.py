"""The optimizers (`OPTIMIZERS`: AdamW with decay / no-decay parameter groups; Muon for the
hidden matrices with AdamW for the rest, muon.py) and the learning-rate schedules.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from llama_ddp.precision import native_bf16
from llama_ddp.train import muon
from llama_ddp.train.muon import Optimizers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def warmup_lr(step: int, lr: float, warmup_steps: int) -> float:
    """Linear from 0.1 x lr at step 0 to lr at ``warmup_steps``."""
    return lr * (0.1 + 0.9 * step / warmup_steps)


@dataclass(frozen=True)
class Schedule:
    """One run's learning-rate schedule: ``schedule(step)`` is the lr of optimizer step ``step``
    (0-based): the shared warmup, then its kind's curve (`SCHEDULES`)."""

    name: str
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_fraction: float | None = None  # set for the kinds that use it (wsd)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return warmup_lr(step, self.lr, self.warmup_steps)
        return SCHEDULES[self.name].after_warmup(step, self)

    def progress(self, step: int) -> float:
        """How far ``step`` is from the end of the warmup (0) to ``total_steps`` (1)."""
        return (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)

    def decay_start(self) -> int | None:
        """The first step of a decay that a resumed run must not undo; None if the kind has
        none (its curve depends on ``total_steps`` throughout)."""
        start = SCHEDULES[self.name].decay_start
        return None if start is None else start(self)

    def changes(self, other: Schedule) -> str:
        """``field old -> new`` for every field ``other`` changes."""
        ours, theirs = asdict(self), asdict(other)
        return ", ".join(f"{k} {ours[k]} -> {theirs[k]}" for k in ours if ours[k] != theirs[k])


def _cosine(step: int, s: Schedule) -> float:
    if step >= s.total_steps:
        return s.min_lr
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1.0 + math.cos(math.pi * s.progress(step)))


def _linear(step: int, s: Schedule) -> float:
    if step >= s.total_steps:
        return s.min_lr
    return s.lr - (s.lr - s.min_lr) * s.progress(step)


def _constant(step: int, s: Schedule) -> float:
    return s.lr


def _wsd_decay_start(s: Schedule) -> int:
    """The last round(decay_fraction x total_steps) steps (at least one) decay, never before the
    warmup ends."""
    decay_steps = max(1, round(s.decay_fraction * s.total_steps))
    return max(s.warmup_steps, s.total_steps - decay_steps)


def _wsd(step: int, s: Schedule) -> float:
    """lr held, then decay step k (0-based) of n runs at lr - (lr - min_lr)(k + 1)/n."""
    start = _wsd_decay_start(s)
    if step < start:
        return s.lr
    if step >= s.total_steps - 1:
        return s.min_lr
    return s.lr - (s.lr - s.min_lr) * (step - start + 1) / (s.total_steps - start)


@dataclass(frozen=True)
class ScheduleKind:
    """One entry of `SCHEDULES`: the lr after the warmup, the help text of ``--lr-schedule``,
    and for a kind whose decay begins at a fixed share of the run (``--decay-fraction``), where
    that decay starts."""

    after_warmup: Callable[[int, Schedule], float]
    help: str
    decay_start: Callable[[Schedule], int] | None = None


# The schedules ``--lr-schedule`` offers; a new one is an entry here and nothing else.
SCHEDULES: dict[str, ScheduleKind] = {
    "cosine": ScheduleKind(_cosine, "cosine from lr down to --min-lr at the last step"),
    "wsd": ScheduleKind(
        _wsd,
        "lr held, then the last --decay-fraction of the steps decay linearly to --min-lr",
        _wsd_decay_start,
    ),
    "linear": ScheduleKind(_linear, "a straight line from lr down to --min-lr"),
    "constant": ScheduleKind(_constant, "lr to the end (--min-lr unused)"),
}


def make_schedule(
    name: str, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
    decay_fraction: float = 0.2,
) -> Schedule:  # fmt: skip
    """The named schedule; ``decay_fraction`` is kept only by the kinds that use it."""
    fraction = decay_fraction if SCHEDULES[name].decay_start is not None else None
    return Schedule(name, lr, min_lr, warmup_steps, total_steps, fraction)


class ScheduleSettings(Protocol):
    """What `build_schedule` reads of a run's settings (config.TrainConfig)."""

    lr_schedule: str
    lr: float
    min_lr: float
    decay_fraction: float

    def warmup(self, total_steps: int) -> int: ...


def build_schedule(cfg: ScheduleSettings, total_steps: int) -> Schedule:
    """The learning-rate schedule a run's settings ask for, over ``total_steps`` optimizer
    steps."""
    return make_schedule(
        cfg.lr_schedule,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        warmup_steps=cfg.warmup(total_steps),
        total_steps=total_steps,
        decay_fraction=cfg.decay_fraction,
    )


def lr_at(step: int, *, schedule: str = "cosine", **shape: Any) -> float:
    """Learning rate of optimizer step ``step`` (0-based) under the named schedule."""
    return make_schedule(schedule, **shape)(step)


class ScheduleState:
    """The run's ``current`` schedule, kept in each checkpoint and read back on resume as
    ``saved``, so that a resumed run can tell what its own schedule changes."""

    def __init__(self, current: Schedule) -> None:
        self.current = current
        self.saved: Schedule | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.current)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = Schedule(**state)

    def __call__(self, step: int) -> float:
        return self.current(step)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (projections, embeddings) decay; vectors (norm weights, biases) do not."""
    return _split_decay(list(model.parameters()), weight_decay)


def _split_decay(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _adamw(
    model: nn.Module, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
    fused: bool | None,
) -> torch.optim.AdamW:  # fmt: skip
    """AdamW over ``groups``; ``fused`` None picks the fused kernel on CUDA and the foreach
    implementation elsewhere."""
    if fused is None:
        fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, eps=eps, fused=fused or None, foreach=None if fused else True
    )


def _adamw_everywhere(
    model: nn.Module, weight_decay: float, *, dtype: torch.dtype, mesh: DeviceMesh | None,
    **adamw: Any,
) -> torch.optim.AdamW:  # fmt: skip
    """AdamW everywhere: its step is elementwise in fp32, on whatever part each rank holds, so
    the run's dtype and ranks change nothing."""
    return _adamw(model, param_groups(model, weight_decay), **adamw)


def _muon_and_adamw(
    model: nn.Module, weight_decay: float, *, dtype: torch.dtype, mesh: DeviceMesh | None,
    **adamw: Any,
) -> Optimizers:  # fmt: skip
    """Muon on the hidden matrices (lr adjusted by shape: match_rms_adamw), AdamW on the rest.
    Newton-Schulz follows the run's ``dtype``: bf16 in a bf16 run where the parameters' device
    multiplies it natively, else fp32 (an fp32 run's, exact to the reduction order in every
    mode; emulated bf16 is many times slower). ``mesh``: see muon.Muon."""
    hidden = muon.hidden_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    bf16 = dtype == torch.bfloat16 and native_bf16(hidden[0].device)
    matrices = muon.Muon(
        hidden,
        lr=adamw["lr"],
        weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
        ns_dtype=torch.bfloat16 if bf16 else torch.float32,
        mesh=mesh,
    )
    return Optimizers(matrices, _adamw(model, _split_decay(rest, weight_decay), **adamw))


@dataclass(frozen=True)
class OptimizerKind:
    """One entry of `OPTIMIZERS`: how ``--optimizer NAME`` builds its optimizer for a model
    (weight decay and AdamW's settings given) and the help text."""

    build: Callable[..., torch.optim.Optimizer | Optimizers]
    lr: float  # its default peak learning rate (--lr)
    help: str


# The optimizers ``--optimizer`` offers; a new one is an entry here.
OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind(
        _adamw_everywhere,
        1e-3,
        "AdamW on every parameter (the article's; --weight-decay on matrices, not on norms)",
    ),
    "muon": OptimizerKind(
        _muon_and_adamw,
        4e-3,
        "torch.optim.Muon on the decoder layers' matrices (attention and MLP projections), its "
        "lr scaled by 0.2 x sqrt(max(rows, cols)) (torch's match_rms_adamw: --lr, the schedule "
        "and --weight-decay carry over from AdamW; momentum 0.95, Nesterov), AdamW on the "
        "embedding, norms and lm_head; Newton-Schulz in the run's precision (fp32 in an fp32 run), "
        "same-shaped matrices together, each rank of DDP or FSDP orthogonalizing its share",
    ),
}


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
    fused: bool | None = None,
    name: str = "adamw",
    dtype: torch.dtype = torch.float32,
    mesh: DeviceMesh | None = None,
) -> torch.optim.Optimizer | Optimizers:
    """The optimizer ``name`` (`OPTIMIZERS`) for ``model``, with the article's AdamW defaults.
    ``fused``: AdamW's implementation (None: the fused kernel on CUDA, foreach elsewhere);
    ``dtype``: the run's compute dtype (precision.Precision); ``mesh``: the ranks that hold the
    same whole gradients (parallelize.replica_mesh: DDP's), which share Muon's work."""
    adamw = {"lr": lr, "betas": betas, "eps": eps, "fused": fused}
    return OPTIMIZERS[name].build(model, weight_decay, dtype=dtype, mesh=mesh, **adamw)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
