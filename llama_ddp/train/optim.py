"""The optimizers (`OPTIMIZERS`: AdamW with decay / no-decay parameter groups; Muon for the
hidden matrices with AdamW for the rest, muon.py) and the learning-rate schedules, and their
settings (OptimizerSettings, ScheduleSettings: the flags --optimizer ... --decay-fraction).

Every schedule is a pure function of the optimizer step, so a resumed run reproduces it exactly.
All share the warmup: linear from 0.1 x lr at step 0 to lr at ``warmup_steps``. Then:
- ``cosine``: cosine from lr down to ``min_lr``, reached at the last step (``total_steps - 1``);
- ``linear``: a straight line from lr down to ``min_lr``, reached at the last step;
- ``constant``: lr to the end (``min_lr`` unused);
- ``wsd`` (warmup, stable, decay): lr held, then the last ``decay_steps`` steps decay linearly,
  the last step running at ``min_lr``. The decay's start depends on ``total_steps`` only through
  ``decay_steps``, so a run extended before its decay started keeps every lr it already used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from llama_ddp.errors import UserError
from llama_ddp.precision import native_bf16
from llama_ddp.settings import FLOAT32_MAX, Settings, choices_help, flag_name, setting
from llama_ddp.train import muon
from llama_ddp.train.muon import Optimizers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Schedule:
    """One run's learning-rate schedule: ``schedule(step)`` is the lr of optimizer step ``step``
    (0-based): the shared warmup, then its kind's curve (`SCHEDULES`); from ``anchor`` on (a
    re-planned decay's step and its lr), the rest of its kind's decay from that lr, never above."""

    name: str
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_fraction: float | None = None  # set for the kinds that use it (wsd)
    anchor: tuple[int, float] | None = None  # (step, lr): a time budget's plan sets it

    def __call__(self, step: int) -> float:
        kind, anchored = SCHEDULES[self.name], self.anchor and step >= self.anchor[0]
        if step < self.warmup_steps and not anchored:
            return self.lr * (0.1 + 0.9 * step / self.warmup_steps)
        if kind.decays and step >= self.total_steps - 1:
            return self.min_lr
        if not anchored:
            return kind.after_warmup(step, self)
        at, lr = self.anchor
        u = (step - at) / max(1, self.total_steps - 1 - at)
        return lr if step == at else min(lr, kind.resumed(u, lr, self))

    def progress(self, step: int) -> float:
        """How far ``step`` is from the end of the warmup (0) to the last step (1)."""
        return (step - self.warmup_steps) / max(1, self.total_steps - 1 - self.warmup_steps)

    def decay_start(self) -> int | None:
        """The first step of a decay that a resumed run must not undo (WSD's); else None."""
        start = SCHEDULES[self.name].decay_start
        return None if start is None else start(self)

    def changes(self, other: Schedule) -> str:
        """``field old -> new`` for every field ``other`` changes."""
        ours, theirs = asdict(self), asdict(other)
        return ", ".join(f"{k} {ours[k]} -> {theirs[k]}" for k in ours if ours[k] != theirs[k])


def _cosine(step: int, s: Schedule) -> float:
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1.0 + math.cos(math.pi * s.progress(step)))


def _cosine_from(u: float, lr: float, s: Schedule) -> float:
    """The cosine on from the phase at which it runs at ``lr``: the rest of its curve."""
    span = s.lr - s.min_lr
    start = math.acos(max(-1.0, min(1.0, 2 * (lr - s.min_lr) / (span or 1) - 1))) / math.pi
    return s.min_lr + 0.5 * span * (1.0 + math.cos(math.pi * (start + (1 - start) * u)))


def _wsd_decay_start(s: Schedule) -> int:
    """The last round(decay_fraction x total_steps) steps (at least one), from the warmup's end."""
    decay_steps = max(1, round(s.decay_fraction * s.total_steps))
    return max(s.warmup_steps, s.total_steps - decay_steps)


def _wsd(step: int, s: Schedule) -> float:
    """lr held, then decay step k (0-based) of n runs at lr - (lr - min_lr)(k + 1)/n."""
    start = _wsd_decay_start(s)
    if step < start:
        return s.lr
    return s.lr - (s.lr - s.min_lr) * (step - start + 1) / (s.total_steps - start)


@dataclass(frozen=True)
class ScheduleKind:
    """One entry of `SCHEDULES`: the lr after the warmup, ``--lr-schedule``'s help, where a decay
    at a share of the run (``--decay-fraction``) starts, whether it decays to ``min_lr``, and
    the rest of a decay from ``lr`` (``u``: 0 at the anchor, 1 at the last step; else straight)."""

    after_warmup: Callable[[int, Schedule], float]
    help: str
    decay_start: Callable[[Schedule], int] | None = None
    decays: bool = True  # to min_lr on the last step; else lr to the end
    resumed: Callable[[float, float, Schedule], float] = lambda u, lr, s: lr - (lr - s.min_lr) * u


# The schedules ``--lr-schedule`` offers; a new one is an entry here and nothing else.
SCHEDULES: dict[str, ScheduleKind] = {
    "cosine": ScheduleKind(
        _cosine, "cosine from lr down to --min-lr at the last step", resumed=_cosine_from
    ),
    "wsd": ScheduleKind(
        _wsd,
        "lr held, then the last --decay-fraction of the steps decay linearly to --min-lr",
        _wsd_decay_start,
    ),
    "linear": ScheduleKind(
        lambda step, s: s.lr - (s.lr - s.min_lr) * s.progress(step),
        "a straight line from lr down to --min-lr at the last step",
    ),
    "constant": ScheduleKind(lambda step, s: s.lr, "lr to the end (--min-lr unused)", decays=False),
}


def make_schedule(name: str, *, decay_fraction: float = 0.2, **shape: Any) -> Schedule:
    """The named schedule of ``shape`` (`Schedule`'s lr, min_lr, warmup_steps, total_steps);
    ``decay_fraction`` is kept only by the kinds that use it."""
    return Schedule(name, **shape, decay_fraction=SCHEDULES[name].decay_start and decay_fraction)


ScheduleName = Literal[tuple(SCHEDULES)]
PROVISIONAL_STEPS = 10**9  # a --time-budget run's length until its first plan (in its warmup)


@dataclass
class ScheduleSettings(Settings):
    """How long a run trains and its learning-rate schedule (the peak lr is the optimizer's)."""

    epochs: int | None = setting(
        None, "passes over the data when neither --max-steps nor --time-budget is given (1)"
    )
    max_steps: int | None = setting(None, "optimizer steps to run (the data cycled as needed)")
    min_lr: float = setting(1e-4, "learning rate at the end of the decay (cosine, wsd, linear)")
    warmup_steps: int | None = setting(
        None,
        "linear warmup steps from 0.1 x lr (default: 100, or a tenth of a shorter run; a "
        "resumed run keeps the warmup it started with)",
    )
    lr_schedule: ScheduleName = setting("cosine", f"after the warmup. {choices_help(SCHEDULES)}")
    decay_fraction: float = setting(0.2, "wsd: the fraction of the steps (the last) that decay")
    time_budget: str | None = setting(
        None,
        "train for this long, from the process's start to its exit, the last evaluation, "
        "checkpoint and exports included: 90s, 10m, 2h, or `slurm` (the SLURM job's time left "
        "less a margin). The steps are planned from measured step times, re-planned as they "
        "change, and end decayed (docs/training.md; wsd suits it best); on a resume it is the "
        "run's total time, the runs before included",
    )

    def check(self) -> None:
        self.positive("epochs", "max_steps")
        if self.time_budget is not None:
            for given in (f for f in ("max_steps", "epochs") if getattr(self, f) is not None):
                raise UserError(f"--time-budget plans the run's length: drop --{flag_name(given)}")
        self.non_negative("warmup_steps")
        if not 0 < self.decay_fraction <= 1:
            raise UserError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")

    def total_steps(self, steps_per_epoch: int | None) -> int:
        """The run's length; a provisional one under --time-budget, whose plan sets it."""
        if self.time_budget is not None:
            return PROVISIONAL_STEPS
        return self.max_steps or (self.epochs or 1) * steps_per_epoch

    def sized(self) -> bool:
        """Whether the sources' sizes set the run's length (epochs)."""
        return self.max_steps is None and self.time_budget is None

    def warmup(self, total_steps: int) -> int:  # the flag, else default_warmup's
        return default_warmup(total_steps) if self.warmup_steps is None else self.warmup_steps


def default_warmup(total_steps: int) -> int:
    """100 steps, never more than a tenth of the run (at least one)."""
    return min(100, max(1, total_steps // 10))


def build_schedule(settings: ScheduleSettings, lr: float, total_steps: int) -> Schedule:
    """The learning-rate schedule ``settings`` ask for, peaking at ``lr``, over ``total_steps``
    optimizer steps."""
    return make_schedule(
        settings.lr_schedule, lr=lr, min_lr=settings.min_lr,
        warmup_steps=settings.warmup(total_steps), total_steps=total_steps,
        decay_fraction=settings.decay_fraction,
    )  # fmt: skip


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
        anchor = state.get("anchor")  # a list in state.json; none in an older checkpoint's
        self.saved = Schedule(**{**state, "anchor": anchor and tuple(anchor)})

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
    compiled: bool, **adamw: Any,
) -> torch.optim.AdamW:  # fmt: skip
    """AdamW everywhere: its step is elementwise in fp32, on whatever part each rank holds, so
    the run's dtype and ranks change nothing."""
    return _adamw(model, param_groups(model, weight_decay), **adamw)


def _muon_and_adamw(
    model: nn.Module, weight_decay: float, *, dtype: torch.dtype, mesh: DeviceMesh | None,
    compiled: bool, **adamw: Any,
) -> Optimizers:  # fmt: skip
    """Muon on the hidden matrices (lr adjusted by shape: match_rms_adamw), AdamW on the rest.
    Newton-Schulz follows the run's ``dtype``: bf16 in a bf16 run where the parameters' device
    multiplies it natively, else fp32 (an fp32 run's, exact to the reduction order in every
    mode; emulated bf16 is many times slower). ``mesh``, ``compiled``: see muon.Muon."""
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
        compiled=compiled,
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
    compiled: bool = False,
) -> torch.optim.Optimizer | Optimizers:
    """The optimizer ``name`` (`OPTIMIZERS`) for ``model``, with the article's AdamW defaults.
    ``fused``: AdamW's implementation (None: the fused kernel on CUDA, foreach elsewhere);
    ``dtype``: the run's compute dtype (precision.Precision); ``mesh``: the ranks that hold the
    same whole gradients (parallelize.replica_mesh: DDP's), which share Muon's work;
    ``compiled``: Muon's Newton-Schulz through torch.compile (where the run compiles)."""
    adamw = {"lr": lr, "betas": betas, "eps": eps, "fused": fused}
    kinds = {"dtype": dtype, "mesh": mesh, "compiled": compiled}
    return OPTIMIZERS[name].build(model, weight_decay, **kinds, **adamw)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


OptimizerName = Literal[tuple(OPTIMIZERS)]
DEFAULT_LRS = ", ".join(f"{name} {kind.lr:g}" for name, kind in OPTIMIZERS.items())


@dataclass
class OptimizerSettings(Settings):
    """The optimizer and its hyperparameters (`OPTIMIZERS`)."""

    optimizer: OptimizerName | None = setting(
        None,
        f"{choices_help(OPTIMIZERS)} (default: the checkpoint's when a run resumes; adamw with "
        "--init-from (the optimizer open models are trained with); muon otherwise, in every "
        "mode)",
    )
    lr: float | None = setting(
        None,
        f"peak learning rate (default: the optimizer's: {DEFAULT_LRS})",
    )
    weight_decay: float = setting(0.1, "weight decay of the matrices (not of norms), decoupled")
    beta1: float = setting(0.9, "AdamW beta1 (Muon's momentum is 0.95)")
    beta2: float = setting(0.99, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 disables clipping")

    def check(self) -> None:
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        self.non_negative("weight_decay", "grad_clip")
        largest = self.lr and muon.largest_step_scalar(self.lr, self.beta1, self.weight_decay)
        if largest and largest > FLOAT32_MAX:
            raise UserError(
                f"--lr {self.lr:g} overflows a float32 in the optimizer's step (its largest "
                f"scalar is about {largest:.3g}, above {FLOAT32_MAX:.3g}) (give a smaller --lr; "
                f"the defaults: {DEFAULT_LRS})"
            )

    def peak_lr(self, name: str, scale: float = 1.0) -> float:
        """--lr, else the default of the optimizer ``name`` times the model's ``scale``."""
        return self.lr if self.lr is not None else OPTIMIZERS[name].lr * scale

    def settled(self, name: str, scale: float = 1.0) -> OptimizerSettings:
        """These settings with the optimizer ``name`` and its peak lr decided."""
        return replace(self, optimizer=name, lr=self.peak_lr(name, scale))

    def build(
        self, model: nn.Module, *, fused: bool | None, dtype: torch.dtype,
        mesh: DeviceMesh | None, compiled: bool = False,
    ) -> torch.optim.Optimizer | Optimizers:  # fmt: skip
        """The settled optimizer for ``model`` (see `build_optimizer`)."""
        return build_optimizer(
            model, lr=self.lr, weight_decay=self.weight_decay, betas=(self.beta1, self.beta2),
            fused=fused, name=self.optimizer, dtype=dtype, mesh=mesh, compiled=compiled,
        )  # fmt: skip
