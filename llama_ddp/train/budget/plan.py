"""The plan's rule: the schedule of a run whose time left holds a number of steps. One pure
function (`plan`) sets the warmup, the decay's start and the total together, so that every plan
ends decayed on its last step, takes at least one more step and no more than the time holds,
and never undoes a decay that began: that decay is re-planned from the lr it has reached, as
continuously, to end sooner or later; no loop, no clock (budget.py measures and calls it).

A schedule whose ``total_steps`` is `PROVISIONAL_STEPS` is a budget run's before its first plan
(run.py builds it so; a checkpoint may keep it): nothing of it is planned yet, its warmup is
provisional too, and no decay of it began.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llama_ddp.train.optim import PROVISIONAL_STEPS, SCHEDULES, Schedule, default_warmup

LONGEST_PLAN = PROVISIONAL_STEPS - 1  # steps: a longer plan would read as provisional


def provisional(schedule: Schedule) -> bool:
    """Whether ``schedule`` is a budget run's before its first plan."""
    return schedule.total_steps == PROVISIONAL_STEPS


def decay_begins(schedule: Schedule) -> int | None:
    """The first step of ``schedule``'s decay: WSD's, or for cosine and linear (which decay from
    the warmup's end to the last step) the warmup's end; None for a kind without a decay
    (constant: a plan may change at any step)."""
    kind = SCHEDULES[schedule.name]
    if not kind.decays:
        return None
    return kind.decay_start(schedule) if kind.decay_start is not None else schedule.warmup_steps


@dataclass(frozen=True)
class Plan:
    """A schedule planned, and what the plan changed that a user should read."""

    schedule: Schedule
    notes: tuple[str, ...] = ()


def plan(
    current: Schedule,
    step: int,
    fit: int,
    *,
    warmup: int | None = None,
    decay_fraction: float | None = None,
) -> Plan:
    """The schedule of a run that took ``step`` steps under ``current`` and whose time left
    holds ``fit`` more (the next one is taken even where it holds none). Its total is
    ``step + fit`` (at least ``step + 1``, at most `LONGEST_PLAN`), except:

    - a run at its end (``step`` at ``current``'s total) is over: a plan never extends it, so
      that a run whose steps are slower than its re-plans still ends;
    - a decay that began (``step`` at or past its start) is never undone: it is re-planned
      (`_decay_replanned`) from the lr ``step`` has under ``current``, continuously, in its
      kind's shape, to ``min_lr`` at the new last step (steeper to end sooner, gentler to end
      later; never upward), its start where it began;
    - the warmup: ``current``'s once planned; at the first plan ``warmup`` (--warmup-steps;
      None: `default_warmup` of the total). A warmup still running that would take more than
      half the run is shortened to `default_warmup` of it, never to before ``step`` (the note
      says where the run then never reaches its peak lr);
    - WSD decays over its last ``decay_fraction`` (None: ``current``'s), or, where that decay
      would have begun before ``step``, from ``step`` on: it never starts in the past;
    - a new run's cosine or linear whose warmup ended before its first plan (--warmup-steps 0
      to 2) runs on from the lr ``step`` has, as a re-planned decay does.

    So the last step (``total - 1``) is past the warmup and, for every kind that decays, at
    ``min_lr``; a constant run's plan says nothing of a decay."""
    if not provisional(current) and step >= current.total_steps:
        return Plan(current)
    end = max(step + 1, min(step + fit, LONGEST_PLAN))
    notes = [] if fit >= 1 else ["the time left holds no more steps: the run ends after the next"]
    begins = None if provisional(current) else decay_begins(current)
    if begins is not None and step >= begins:
        return _decay_replanned(current, step, end, begins, notes)
    if not provisional(current):
        wanted = current.warmup_steps
    else:
        wanted = warmup if warmup is not None else default_warmup(end)
    chosen = wanted
    if wanted > step and wanted > end // 2:
        chosen = min(max(step, default_warmup(end)), end - 1)
    kind = SCHEDULES[current.name]
    fraction = None
    if kind.decay_start is not None:
        fraction = decay_fraction if decay_fraction is not None else current.decay_fraction
    schedule = replace(current, warmup_steps=chosen, total_steps=end, decay_fraction=fraction)
    start = decay_begins(schedule)
    if kind.decay_start is not None and start is not None and start < step:
        schedule = replace(schedule, decay_fraction=(end - step) / end)
        notes.append(f"the decay moved to the next step, {step}: the time holds no later start")
    if kind.decay_start is None and kind.decays and step > max(chosen, current.warmup_steps):
        schedule = replace(schedule, anchor=(step, current(step)))  # a --warmup-steps under 3
    if chosen != wanted:
        notes.append(
            f"warmup shortened from {wanted} to {chosen} steps: it would take more than half "
            f"of the {end} steps planned{_unreached(schedule, step)}"
        )
    return Plan(schedule, tuple(notes))


def _decay_replanned(current: Schedule, step: int, end: int, begins: int, notes: list) -> Plan:
    """``current``'s decay, begun at ``begins``, re-planned at ``step`` to end at ``end``: from
    the lr ``current`` gives ``step`` (the schedule's anchor: a resumed run reads it back) down
    to ``min_lr`` at ``end - 1``, in the kind's shape (optim.Schedule); WSD's start kept where
    it began. Where ``end`` is the next step, that step is the last, at ``min_lr``."""
    if end == current.total_steps:
        return Plan(current, tuple(notes))
    schedule = replace(current, total_steps=end, anchor=(step, current(step)))
    if SCHEDULES[current.name].decay_start is not None:
        schedule = replace(schedule, decay_fraction=(end - begins) / end)
    way = "steeper, to end sooner" if end < current.total_steps else "gentler, to end later"
    notes.append(f"its decay began at step {begins}: now {way}")
    return Plan(schedule, tuple(notes))


def _unreached(schedule: Schedule, step: int) -> str:
    """Where the run never runs at its peak lr (a warmup that ends at its decay): its note."""
    first = max(step, schedule.warmup_steps)  # the warmup's end, or the next step past it
    if math.isclose(schedule(first), schedule.lr, rel_tol=1e-9):  # cosine's: min_lr + lr - min_lr
        return ""
    where = "the last, at --min-lr" if first == schedule.total_steps - 1 else "in the decay"
    return f"; the run never reaches its peak lr (step {first}, the warmup's end, is {where})"
