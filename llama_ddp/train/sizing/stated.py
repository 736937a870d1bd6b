"""--model-size auto's choice for a device stated rather than at hand (``python -m llama_ddp.plan
--peak-tflops ...``): each candidate's step time from its FLOPs, the device's peak and a model
FLOPs utilization, and the same search (rule.py's `choose`) on a clock that the timing of each
candidate moves as it would move a run's: what auto would choose there, on the same code path."""

from __future__ import annotations

from dataclasses import dataclass

from llama_ddp.errors import UserError
from llama_ddp.train.budget.budget import TIMED_STEPS
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.sizing.rule import MEASURE_SHARE, Choice, Size, choose


@dataclass(frozen=True)
class Device:
    """``devices`` accelerators of ``peak_tflops`` (dense, the run's precision) each, at ``mfu``
    of it (model FLOPs utilization: 6N + attention per token, as `Size.flops` counts them)."""

    peak_tflops: float
    mfu: float
    devices: int

    def step_s(self, size: Size, step_tokens: int) -> float:
        return size.flops * step_tokens / (self.peak_tflops * 1e12 * self.mfu * self.devices)


class _Clock:
    """The run's time as the plan simulates it: the timing of the candidates moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def choose_stated(
    cfg: TrainConfig, sizes: list[Size], device: Device, corpus_tokens: int | None
) -> Choice:
    """The choice auto would make for ``cfg`` (--model-size auto, its --time-budget) on
    ``device``, its timing of each candidate (a warm-up and the timed steps) paid from the
    budget as a run pays it; the run's start-up before the timing is not counted. A budget
    that holds no step of the smallest member is a UserError."""
    step_tokens = cfg.data.batch_size * cfg.data.seq_length
    clock = _Clock()

    def budget(size: Size):
        b = cfg.time_budget(size.parameters, 0.0)
        b.clock, b.origin = clock, 0.0
        if b.deadline is not None:  # slurm's end, on the real clock: the time left, from 0
            b.deadline = b.seconds
        return b

    def measure(size: Size) -> float:
        step_s = device.step_s(size, step_tokens)
        clock.now += (1 + TIMED_STEPS) * step_s
        return step_s

    def fit(size: Size, step_s: float) -> int:
        return budget(size).fit(step_s)

    first = budget(sizes[0])
    choice = choose(sizes, measure, fit, step_tokens, MEASURE_SHARE * first.left(), clock,
                    corpus_tokens=corpus_tokens)  # fmt: skip
    if choice.best.steps <= 0:
        smallest = device.step_s(sizes[0], step_tokens)
        raise UserError(
            f"--time-budget {cfg.schedule.time_budget} holds no step: the end alone keeps "
            f"{first.reserve(smallest):.1f} s and a step of depth {sizes[0].depth} takes "
            f"{smallest:.3g} s on this device (give a longer --time-budget)"
        )
    return choice
