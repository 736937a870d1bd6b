"""The time budget's owner (`Budget`): its clock, what was measured, and when the run's length is
planned. The trainer asks it at each step boundary (`Budget.after_step`: a new plan, or None)
and reports what it measured (`Budget.report`: each evaluation's and save's seconds); run.py
starts it (`Budget.start`: a resumed run's plan so far, or one line when no step fits) and, after
the end, asks whether it came late (`Budget.end_line`).

The budget counts from the process's start (start-up and compiling are paid from it) and, on a
resume, from the seconds the runs before it spent (kept in the train state); an absolute one
(``slurm``) ends at its ``deadline`` whatever ran before (a torchrun restart, a requeue). An
evaluation at step 0 is paid from it too, and kept apart from the end's estimate. After the
first step (compiling, warming caches: paid, not timed) and ``TIMED_STEPS`` timed steps, it
plans: the steps that fit (`Budget.fit`) are those whose mean time over the recent half of the
steps timed so far (`Budget.step_time`) fits in the time left (`Budget.left`) less the time kept
for the end (`Budget.reserve`: the final evaluation, the last checkpoint, the exports, a
margin), and plan.py's rule turns them into a schedule. It plans again every `Budget.interval`
seconds (budget / 30; near the end, a quarter of the training time left) and after each new
measurement: a slower or faster machine moves the end, never a decay that began. Everything
reads the time through ``clock``, so tests drive it with a fake one.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, NamedTuple

from llama_ddp.errors import UserError
from llama_ddp.train.budget.duration import SLURM_MARGIN, parse_duration, slurm_end
from llama_ddp.train.budget.plan import decay_begins, plan, provisional
from llama_ddp.train.optim import Schedule, ScheduleState

TIMED_STEPS = 2  # timed steps before the first plan
PACE_STEPS = 5  # steps since a plan whose median may slow the next: one stall among them is not it
# A held-out token's share of a training step's token: its forward (a third of the forward and
# backward) and the evaluation's own work (its batches, the bytes counted): the end's estimate
EVAL_TOKEN_STEPS = 0.5
HELD_OUT_GUESS = 8.0  # --eval-tokens all's steps until the held-out split's size is known
CLOCK: Callable[[], float] = time.monotonic  # a budget's clock (tests set a fake one)
WALL: Callable[[], float] = time.time  # the Unix time, for SLURM's end (tests set a fake one)


def spent_of(train: Mapping[str, Any]) -> float:
    """The budget's seconds a checkpoint's train state spent; one of a run without a budget: its
    loop's seconds; nothing (a new run): 0."""
    return float(train.get("budget_spent_s", sum(train.get("seconds", {}).values())))


class Replan(NamedTuple):
    """A new plan: the schedule to follow and its line for the log."""

    schedule: Schedule
    line: str


def _alone(value: Any) -> Any:
    return value


@dataclass
class Budget:
    """A run's time budget, its clock started at the process's start: ``origin`` is the clock's
    reading then, ``spent_before`` the seconds earlier runs of it spent. With a ``deadline`` (a
    reading of ``clock``: SLURM's end) it is absolute: ``seconds`` are those from the process's
    start to it, and the runs before count for nothing more."""

    seconds: float
    origin: float
    end_estimate_s: float  # the last save and the exports
    eval_steps: float = 2.0  # the final evaluation's estimate in steps, until one is measured
    clock: Callable[[], float] = time.monotonic
    spent_before: float = 0.0
    replan_s: float = 0.0  # between plans (0: budget / 30, at least 5 s)
    warmup: int | None = None  # --warmup-steps, for the first plan (None: a tenth of the run)
    decay_fraction: float | None = None  # --decay-fraction: WSD's, for every plan
    tokens_per_step: int = 0  # the global batch's, for the plan's line
    share: Callable[[Any], Any] = _alone  # rank 0's value (a plan, a verdict) to every rank
    # "eval", "save": the last one's seconds; "first_eval": the evaluation before the first step
    measured: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[int, float]] = field(default_factory=list)  # (step, clock) of each step
    last_plan: float | None = None  # the clock at the last plan
    planned_at: int | None = None  # the step of the last plan
    deadline: float | None = None  # an absolute budget's end, on ``clock``
    remeasured: bool = False  # a new evaluation or save measured: plan at the next boundary
    kept: float = 0.0  # seconds the last plan kept for the end
    # --eval-tokens all: the held-out targets, once every validation split is built (None
    # before), replace the ``held_out_guess`` steps of ``eval_steps`` at the next boundary
    held_out: Callable[[], int | None] | None = None
    held_out_guess: float = 0.0

    def __post_init__(self) -> None:
        self.replan_s = self.replan_s or max(5.0, self.seconds / 30)

    # ----------------------------------------------------------------- what it knows

    def elapsed(self) -> float:
        """The budget's seconds spent, by this process and the runs it resumes."""
        return self.spent_before + self.clock() - self.origin

    def left(self) -> float:
        if self.deadline is not None:
            return self.deadline - self.clock()
        return self.seconds - self.elapsed()

    def margin(self) -> float:
        """Kept beyond the end's own time: the process's exit and the timing's noise."""
        return 2.0 + 0.02 * self.seconds

    def evaluation(self, step_s: float) -> float:
        """The final evaluation's seconds: the last evaluation's after the first step (the same
        work, warm); before one, ``eval_steps`` steps of ``step_s``, at most what the evaluation
        before the first step took (``first_eval``: a first scoring, 20 times a later one's on
        2 loaded cores, is a bound, never the estimate)."""
        if "eval" in self.measured:
            return self.measured["eval"]
        return min(self.eval_steps * step_s, self.measured.get("first_eval", math.inf))

    def reserve(self, step_s: float) -> float:
        """Seconds kept for the end: the last evaluation (`evaluation`), the last save and the
        exports (the larger of the estimate and the last save measured, twice), the margin."""
        save = max(self.end_estimate_s, 2 * self.measured.get("save", 0.0))
        return self.evaluation(step_s) + save + self.margin()

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

    def plan_step_time(self, step: int, step_s: float) -> float:
        """The step time a plan counts on: ``step_s`` (`step_time`), or the median step since
        the last plan where it is slower (of at least `PACE_STEPS` steps): a slowdown near
        the end ends the run sooner at the next plan, before the recent half of the run has
        seen it, while one stall, an evaluation or a save between two steps does not (a mean
        since the plan would take a single 10-s stall for the pace and end the run at once)."""
        if self.planned_at is None or step < self.planned_at + PACE_STEPS:
            return step_s
        recent = self.samples[bisect.bisect_left(self.samples, (self.planned_at, -math.inf)) :]
        return max(step_s, statistics.median(b - a for (_, a), (_, b) in pairwise(recent)))

    def interval(self, step_s: float) -> float:
        """Seconds between plans: ``replan_s``, and near the end a quarter of the training time
        left (at least 1 s): the margin then covers a drift of the step time over a quarter of
        what is left, not over budget / 30 (3.3%, more than its 2%)."""
        training = self.left() - self.reserve(step_s)
        return min(self.replan_s, max(1.0, training / 4))

    def fit(self, step_s: float) -> int:
        """The steps of ``step_s`` seconds the time left holds, the end's reserve kept."""
        return math.floor((self.left() - self.reserve(step_s)) / max(step_s, 1e-9))

    # ----------------------------------------------------------------- the trainer's questions

    def start(self, schedule: ScheduleState, step: int) -> list[str]:
        """Before the first step, on every rank: a resumed run (``schedule.saved``, at ``step``)
        follows its checkpoint's plan so far (length, warmup, decay fraction), re-planned from
        here on; the lines to print (a checkpoint that finished its schedule: nothing left to
        train). A UserError when the time left cannot hold a step and the end."""
        saved = schedule.saved
        if saved is not None:
            fraction = saved.decay_fraction if saved.name == schedule.current.name else None
            schedule.current = replace(
                schedule.current,
                total_steps=saved.total_steps,
                warmup_steps=saved.warmup_steps,
                decay_fraction=fraction or schedule.current.decay_fraction,
                anchor=saved.anchor if saved.name == schedule.current.name else None,
            )
            if not provisional(saved) and step >= saved.total_steps:
                return [
                    f"note: the checkpoint at step {step} is its run's end (the last step of its "
                    f"{saved.name} schedule): nothing is left to train, and a larger "
                    "--time-budget does not extend a finished run (to train on, start a new "
                    "one in another --out-dir with --init-from this one's llama_model.pth)"
                ]
        end = self.reserve(0.0)
        if not self.share(self.left() <= end):  # rank 0's clock decides for every rank
            return []
        if self.deadline is not None:
            raise UserError(
                f"the SLURM job's time left holds no step: {max(0.0, self.left()):.0f} s to its "
                f"end less {SLURM_MARGIN:.0f} s, and the end (the last evaluation, save and "
                f"exports) needs about {end:.0f} s (resubmit the job with a longer --time)"
            )
        if saved is None:
            raise UserError(
                f"the time budget of {self.seconds:g} s holds no step: the start-up took "
                f"{self.elapsed():.1f} s of it and the end (the last evaluation, save and "
                f"exports) needs about {end:.0f} s (give a larger --time-budget)"
            )
        raise UserError(
            f"the time budget of {self.seconds:.0f} s is spent: the runs before this one took "
            f"{self.spent_before:.0f} s of it (resume with a larger --time-budget, the run's "
            "total time)"
        )

    def after_step(self, step: int, schedule: Schedule) -> Replan | None:
        """At the boundary after ``step`` under ``schedule``: rank 0's new plan where one is due
        (the first, or every ``replan_s`` seconds where it changes), on every rank; else None."""
        return self.share(self._plan(step, schedule))

    def report(self, what: str, seconds: float) -> None:
        """The seconds the run measured of ``what`` ("eval": an evaluation; "save": a checkpoint
        from its start to the complete folder), on every rank: the end will take as long, and
        the next boundary plans with it. An evaluation before the first step (step 0's) is the
        budget's to pay, its time gone from the time left, and is kept apart (``first_eval``, a
        bound on the end's: `evaluation`); where the time left cannot hold a step and the end
        after it, a UserError before training."""
        if what == "eval" and not self.samples:
            self.measured["first_eval"] = seconds
            self._check_first(seconds)
            return
        self.measured[what] = seconds
        self.remeasured = True

    def _check_first(self, seconds: float) -> None:
        step_s = seconds / max(self.eval_steps, 1.0)  # a step, as the evaluation's cost implies
        need = step_s + self.reserve(step_s)  # the end's evaluation taken as long as this one
        left = self.left()
        if not self.share(left <= need):
            return
        fix = (
            "resubmit the job with a longer --time"
            if self.deadline is not None
            else "give a larger --time-budget"
        )
        raise UserError(
            f"the time budget holds no step after the evaluation at step 0: it took "
            f"{seconds:.1f} s, {max(0.0, left):.0f} s are left, and a step and the end (the last "
            f"evaluation, save and exports) need about {need:.0f} s ({fix}, or evaluate at the "
            "end only: --eval-every 0)"
        )

    def end_line(self) -> str | None:
        """Once the run's end is done (evaluation, save, exports): None within the budget; else
        the line that says by how much it missed and what the end took against what was kept."""
        if self.left() >= 0 or not self.samples:
            return None
        took = self.clock() - self.samples[-1][1]  # since the last step's boundary
        return (
            f"time budget: ended {-self.left():.1f} s late: the end (evaluation, save, exports) "
            f"took {took:.1f} s, {self.kept:.1f} s were kept for it at the last plan (a busy "
            "machine's steps or end slower than measured)"
        )

    def log(self) -> dict[str, float]:
        """The fields of a metrics line (the progress line shows them)."""
        return {"time_left_s": round(self.left(), 1)}

    # ----------------------------------------------------------------- saved with the train state

    def state_dict(self) -> dict[str, float]:
        return {"budget_spent_s": self.elapsed()}

    def load_state_dict(self, train: dict[str, Any]) -> None:
        self.spent_before = spent_of(train)

    # ----------------------------------------------------------------- its plan and its lines

    def _learn_held_out(self) -> None:
        """--eval-tokens all: the final evaluation's estimate from the held-out split's size
        (`EVAL_TOKEN_STEPS` a token), once it is known, in place of the guess; a new plan."""
        if self.held_out_guess and self.held_out is not None and (n := self.held_out()) is not None:
            known = EVAL_TOKEN_STEPS * n / max(self.tokens_per_step, 1)
            self.eval_steps += known - self.held_out_guess
            self.held_out, self.held_out_guess, self.remeasured = None, 0.0, True

    def _plan(self, step: int, schedule: Schedule) -> Replan | None:
        self._learn_held_out()
        now = self.clock()
        self.samples.append((step, now))
        step_s = self.step_time(step)
        if step_s is None:
            return None
        step_s = self.plan_step_time(step, step_s)
        waited = math.inf if self.last_plan is None or self.remeasured else now - self.last_plan
        if waited < self.interval(step_s):
            return None
        first, self.last_plan, self.planned_at = self.last_plan is None, now, step
        self.remeasured, self.kept = False, self.reserve(step_s)
        planned = plan(
            schedule, step, self.fit(step_s), warmup=self.warmup, decay_fraction=self.decay_fraction
        )
        if planned.schedule == schedule and not first:
            return None
        new, total = planned.schedule, planned.schedule.total_steps
        what = "plan" if provisional(schedule) else f"re-planned at step {step}"
        notes = "".join(f"; {note}" for note in planned.notes)
        begins = decay_begins(new)
        decay = "no decay" if begins is None else f"decay from step {begins}"
        line = (
            f"time budget: {what}: {total} steps ({total * self.tokens_per_step / 1e6:.2f}M "
            f"tokens) at {step_s:.3f} s a step, {self.left():.0f} s left, "
            f"{self.kept:.1f} s kept for the end (evaluation, save, exports), warmup "
            f"{new.warmup_steps}, {decay}{notes}"
        )
        return Replan(new, line)

    def banner(self) -> str:
        what = (
            f"the SLURM job's end less {SLURM_MARGIN:.0f} s"
            if self.deadline is not None
            else f"{self.seconds:.0f} s from the process's start"
        )
        return (
            f"time budget: {what} ({self.left():.0f} s left), the steps planned after "
            f"{TIMED_STEPS + 1} steps and re-planned every {self.replan_s:.0f} s, more often "
            "near the end (a decay that began runs on from the lr it reached)"
        )


def make_budget(
    text: str,
    *,
    parameters: int,
    exports: int,
    eval_steps: float,
    warmup: int | None,
    decay_fraction: float | None,
    tokens_per_step: int,
    age: float | None,
    env: Mapping[str, str],
    held_out_guess: float = 0.0,
) -> Budget:
    """The budget of --time-budget ``text``, its clock started ``age`` seconds ago (the
    process's start); ``slurm``'s ends at the job's end (`slurm_end`), its deadline. The end is
    estimated from the model's ``parameters``: the last save (weights and optimizer state) and
    ``exports`` copies of the weights, at 100 MB/s; the final evaluation as ``eval_steps``
    training steps until one is measured (``held_out_guess`` of them a guess of --eval-tokens
    all's, until `Budget.held_out` knows the split's size)."""
    clock, now = CLOCK, WALL()
    origin = clock() - (age or 0.0)
    deadline = clock() + slurm_end(env, now) - now if text == "slurm" else None
    seconds = parse_duration(text, env, now) if deadline is None else deadline - origin
    end = 1.0 + parameters * 4 * (3 + exports) / 1e8
    return Budget(
        seconds, origin, end, eval_steps=eval_steps, clock=clock, warmup=warmup,
        decay_fraction=decay_fraction, tokens_per_step=tokens_per_step, deadline=deadline,
        held_out_guess=held_out_guess,
    )  # fmt: skip
