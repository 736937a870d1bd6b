"""The time budget (``--time-budget``): how many steps fit, planned from measured step times.

The budget counts from the process's start (start-up and compiling are paid from it) and, on a
resume, from the seconds the runs before it spent (kept in the train state). After the first
step (compiling, warming caches: paid, not timed) and ``TIMED_STEPS`` timed steps, `Budget.plan`
sets the run's total steps: the steps whose mean time over the recent half of the steps timed
so far fits in the time left less the time kept for the end (the final evaluation, the last
checkpoint, the exports, and a margin). It plans again every ``replan_s`` seconds while the
schedule is before its decay (`decay_begins`): a slower or faster machine moves the end, never a
decay that began. Everything here reads the time through ``clock``, so tests drive it with a
fake one.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from llama_ddp.errors import UserError
from llama_ddp.train.optim import SCHEDULES, Schedule, ScheduleState

UNITS = {"s": 1, "m": 60, "h": 3600}
SLURM_MARGIN = 0.05  # of the job's time left, at least a minute: start-up, teardown, the kill
TIMED_STEPS = 2  # timed steps before the first plan


def parse_duration(text: str, env: Mapping[str, str], now: float) -> float:
    """Seconds of ``90s``, ``10m``, ``2h`` (or ``1.5h``); ``slurm``: the SLURM job's time left
    (``SLURM_JOB_END_TIME``, a Unix time, against ``now``) less `SLURM_MARGIN`, at least 60 s."""
    if text == "slurm":
        end = env.get("SLURM_JOB_END_TIME")
        if not end:
            raise UserError(
                "--time-budget slurm needs SLURM_JOB_END_TIME, which is not set (run it inside a "
                "SLURM job, or give a duration such as 2h)"
            )
        left = float(end) - now
        seconds = left - max(60.0, SLURM_MARGIN * left)
        if seconds <= 0:
            raise UserError(f"the SLURM job has {left:.0f} s left: too little to train (resubmit)")
        return seconds
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text.strip())
    seconds = float(match[1]) * UNITS[match[2]] if match else 0.0
    if seconds <= 0:
        raise UserError(f"--time-budget must be a duration such as 90s, 10m or 2h, got {text!r}")
    return seconds


def decay_begins(schedule: Schedule, total_steps: int) -> int | None:
    """The first step of ``schedule``'s decay were the run ``total_steps`` long: WSD's decay, or
    for cosine and linear (which decay from the warmup's end to the last step) the warmup's end;
    None for constant (no decay, a plan may change at any step)."""
    kind = SCHEDULES[schedule.name]
    if kind.decay_start is not None:
        return kind.decay_start(replace(schedule, total_steps=total_steps))
    return None if schedule.name == "constant" else schedule.warmup_steps


@dataclass
class Budget:
    """A run's time budget and its plan, its clock started at the process's start: ``origin``
    is the clock's reading then, ``spent_before`` the seconds earlier runs of it spent."""

    seconds: float
    origin: float
    end_estimate_s: float  # the last save and the exports
    eval_steps: float = 2.0  # the final evaluation's estimate in steps, until one is measured
    clock: Callable[[], float] = time.monotonic
    spent_before: float = 0.0
    replan_s: float = 0.0  # between plans (0: budget / 30, at least 5 s)
    measured: dict[str, float] = field(default_factory=dict)  # "eval", "save": their last seconds
    samples: list[tuple[int, float]] = field(default_factory=list)  # (step, clock) of each step
    last_plan: float | None = None  # the clock at the last plan
    warmup: Callable[[int], int] | None = None  # the warmup of a run's length, set at 1st plan

    def __post_init__(self) -> None:
        self.replan_s = self.replan_s or max(5.0, self.seconds / 30)

    def elapsed(self) -> float:
        """The budget's seconds spent, by this process and the runs it resumes."""
        return self.spent_before + self.clock() - self.origin

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def margin(self) -> float:
        """Kept beyond the end's own time: the process's exit and the timing's noise."""
        return 2.0 + 0.02 * self.seconds

    def reserve(self, step_s: float) -> float:
        """Seconds kept for the end: the last evaluation (as measured, else ``eval_steps``
        steps of ``step_s``), the last save and the exports (the larger of the estimate and
        the last save measured, twice), the margin."""
        evaluation = self.measured.get("eval", self.eval_steps * step_s)
        return (
            evaluation
            + max(self.end_estimate_s, 2 * self.measured.get("save", 0.0))
            + self.margin()
        )

    def step_time(self, step: int) -> float | None:
        """Mean seconds per step over the recent half of the steps timed so far (at least
        `TIMED_STEPS`; None before): a machine that got slower or faster (another job beside
        it, a burst of CPU steal at the start) moves the plan within half the run so far, not
        in proportion to all of it; periodic evaluations and saves included, as they recur."""
        if not self.samples or step - self.samples[0][0] < TIMED_STEPS:
            return None
        first = self.samples[0][0]  # the first step paid its warm-up: timing begins after it
        mid = min(first + (step - first) // 2, step - TIMED_STEPS)
        since, start = self.samples[max(0, bisect.bisect_right(self.samples, (mid, math.inf)) - 1)]
        return (self.clock() - start) / (step - since)

    def plan(self, step: int, schedule: Schedule) -> Schedule:
        """The run's schedule after ``step`` steps: unchanged before the first timed steps,
        between plans and once its decay began; else as long as the steps that fit in the time
        left less `reserve` (at least one more), never moving the decay's start before the next
        step. The first plan also sets the warmup (``warmup``: its default for a run's length;
        None: the warmup stays)."""
        now = self.clock()
        self.samples.append((step, now))
        step_s = self.step_time(step)
        if step_s is None or (self.last_plan is not None and now - self.last_plan < self.replan_s):
            return schedule
        begins = decay_begins(schedule, schedule.total_steps)
        if begins is not None and step >= begins:
            return schedule
        first, self.last_plan = self.last_plan is None, now
        fit = math.floor((self.left() - self.reserve(step_s)) / max(step_s, 1e-9))
        total = step + max(1, fit)
        if first and self.warmup is not None:
            schedule = replace(schedule, warmup_steps=min(self.warmup(total), total - 1))
        while (begins := decay_begins(schedule, total)) is not None and begins < step:
            total += 1  # a shorter plan would start its decay in the past
        return replace(schedule, total_steps=total)

    def spent_line(self) -> str | None:
        """The one line of a resumed run whose budget is spent (None: time is left)."""
        if self.left() > self.reserve(0.0):
            return None
        return (
            f"the time budget of {self.seconds:.0f} s is spent: the runs before this one took "
            f"{self.spent_before:.0f} s of it (resume with a larger --time-budget, the run's "
            "total time)"
        )

    def banner(self) -> str:
        return (
            f"time budget: {self.seconds:.0f} s from the process's start ({self.left():.0f} s "
            f"left), the steps planned after {TIMED_STEPS + 1} steps and re-planned every "
            f"{self.replan_s:.0f} s until the decay"
        )

    def plan_line(self, step: int, schedule: Schedule, tokens_per_step: int, first: bool) -> str:
        """The plan (``first``) or a re-plan, one line."""
        step_s = self.step_time(step) or 0.0
        total = schedule.total_steps
        what = "plan" if first else f"re-planned at step {step}"
        return (
            f"time budget: {what}: {total} steps ({total * tokens_per_step / 1e6:.2f}M tokens) "
            f"at {step_s:.3f} s a step, {self.left():.0f} s left, {self.reserve(step_s):.1f} s "
            f"kept for the end (evaluation, save, exports), decay from step "
            f"{decay_begins(schedule, total)}"
        )


def make_budget(
    text: str,
    *,
    parameters: int,
    exports: int,
    eval_steps: float,
    warmup: Callable[[int], int] | None,
    age: float | None,
    env: Mapping[str, str],
) -> Budget:
    """The budget of --time-budget ``text``, its clock started ``age`` seconds ago (the
    process's start). The end is estimated from the model's ``parameters``: the last save
    (weights and optimizer state) and ``exports`` copies of the weights, at 100 MB/s; the final
    evaluation as ``eval_steps`` training steps until one is measured."""
    seconds = parse_duration(text, env, time.time())
    end = 1.0 + parameters * 4 * (3 + exports) / 1e8
    origin = time.monotonic() - (age or 0.0)
    return Budget(seconds, origin, end, eval_steps=eval_steps, warmup=warmup)


def resumed(budget: Budget, schedule: ScheduleState) -> int:
    """A resumed run's plan so far, its checkpoint's length and warmup (re-planned from here
    on); a UserError when its budget is spent."""
    if (line := budget.spent_line()) is not None:
        raise UserError(line)
    saved = schedule.saved
    assert saved is not None  # loaded with the checkpoint
    budget.warmup = None  # the first run's plan set it
    schedule.current = replace(
        schedule.current, total_steps=saved.total_steps, warmup_steps=saved.warmup_steps
    )
    return saved.total_steps
