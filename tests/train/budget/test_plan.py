"""The plan's rule (train/budget/plan.py): the warmup, the decay's start and the total of a run
whose time left holds ``fit`` more steps, one pure function; the clock and the measuring are
test_budget.py's."""

import itertools
import math
import random
from dataclasses import replace

import pytest

from llama_ddp.train.budget.plan import LONGEST_PLAN, decay_begins, plan, provisional
from llama_ddp.train.optim import PROVISIONAL_STEPS, SCHEDULES, make_schedule

LR, MIN_LR = 1e-3, 1e-4


def schedule(name: str = "wsd", warmup: int = 100, total: int = PROVISIONAL_STEPS, **kw):
    return make_schedule(name, lr=LR, min_lr=MIN_LR, warmup_steps=warmup, total_steps=total, **kw)


def test_the_first_plan_fits_the_steps_and_sets_the_warmup():
    planned = plan(schedule(), 3, 158).schedule
    assert (planned.total_steps, planned.warmup_steps) == (161, 16)  # a tenth of the run
    assert decay_begins(planned) == 161 - 32  # wsd's last fifth
    assert planned.lr == LR and planned.name == "wsd" and planned.decay_fraction == 0.2
    assert planned(160) == MIN_LR and planned(159) > MIN_LR


def test_a_short_first_plan_of_cosine_ends_decayed_without_a_loop():
    """Issue 52, item 1: a first plan under 30 steps made the warmup (a tenth) end before the
    step reached, and the loop that pushed the total past the decay's start never ended (cosine
    decays from the warmup's end, whatever the total). 7 steps at step 3: warmup 1, the last
    step (6) at min_lr."""
    for name in ("cosine", "linear"):
        planned = plan(schedule(name), 3, 4).schedule
        assert (planned.total_steps, planned.warmup_steps) == (7, 1)
        assert planned(6) == MIN_LR and planned(3) > planned(5) > MIN_LR


def test_a_warmup_of_a_step_is_planned_not_skipped():
    """Issue 52, item 2: --warmup-steps 1 (any warmup <= 3) made the first plan find "the decay
    begun" and return none: the run trained past its budget at its peak lr."""
    planned = plan(schedule("cosine", warmup=1), 3, 12, warmup=1).schedule
    assert (planned.total_steps, planned.warmup_steps) == (15, 1)
    assert planned(14) == MIN_LR


def test_a_checkpoints_decay_that_began_ends_where_the_time_does_from_the_lr_it_reached():
    """Issue 52, item 2: a fixed-steps cosine checkpoint (50 steps, warmup 5) past its warmup,
    resumed under a budget at step 20, ran on to step 50 whatever the time. Now: the time left
    holds 10 steps: the run ends at step 30, its decay steeper from step 20's lr, the last step
    at min_lr; it holds 40: the run ends at step 60, its decay gentler (issue 58, item 4: a
    budget is used, not left; before, the checkpoint's end stayed); 30: the end stays."""
    fixed = schedule("cosine", warmup=5, total=50)
    shorter = plan(fixed, 20, 10)
    assert shorter.schedule == replace(fixed, total_steps=30, anchor=(20, fixed(20)))
    assert shorter.schedule(29) == MIN_LR and shorter.schedule(20) == fixed(20)
    assert shorter.schedule(21) < fixed(21)
    assert shorter.notes == ("its decay began at step 5: now steeper, to end sooner",)
    longer = plan(fixed, 20, 40)
    assert longer.schedule == replace(fixed, total_steps=60, anchor=(20, fixed(20)))
    assert fixed(20) > longer.schedule(21) > fixed(21) and longer.schedule(59) == MIN_LR
    assert longer.notes == ("its decay began at step 5: now gentler, to end later",)
    same = plan(fixed, 20, 30)
    assert same.schedule is fixed and same.notes == ()


def test_a_provisional_checkpoints_warmup_is_chosen_by_the_plan():
    """Issue 52, item 3: a budget run stopped before its first plan kept the provisional warmup
    of 100, and the resumed run's 82-step plan ended at step 82 undecayed (lr 3.3e-3)."""
    planned = plan(schedule("cosine"), 4, 78).schedule
    assert (planned.total_steps, planned.warmup_steps) == (82, 8)
    assert planned(81) == MIN_LR


@pytest.mark.parametrize(
    ("current", "step", "fit", "warmup", "expected"),
    [
        # a fixed-steps checkpoint in its warmup (10 of 100) resumed: 13 steps fit
        (schedule("cosine", warmup=10, total=100), 3, 10, None, (13, 3)),
        # --warmup-steps 50 --lr-schedule wsd, 30 steps fit: a tenth of the run, 3
        (schedule("wsd", warmup=50), 3, 27, 50, (30, 3)),
        # --warmup-steps 20 of a run of 200: kept (it is under half)
        (schedule("wsd", warmup=20), 3, 197, 20, (200, 20)),
        # a warmup longer than the run: shortened to the step reached (a tenth would be past)
        (schedule("linear", warmup=10, total=100), 6, 2, None, (8, 6)),
    ],
)
def test_a_warmup_longer_than_half_the_run_is_shortened_and_said(
    current, step, fit, warmup, expected
):
    planned = plan(current, step, fit, warmup=warmup)
    assert (planned.schedule.total_steps, planned.schedule.warmup_steps) == expected
    assert planned.schedule(expected[0] - 1) == MIN_LR
    wanted = warmup if warmup is not None else current.warmup_steps
    if expected[1] != wanted:
        total, chosen = expected
        assert planned.notes[-1] == (
            f"warmup shortened from {wanted} to {chosen} steps: it would take more than half of "
            f"the {total} steps planned"
        )
    else:
        assert planned.notes == ()


def test_a_shorter_wsd_plan_never_starts_its_decay_in_the_past_nor_overruns():
    """At step 60 of a 161-step WSD plan (decay from 129), one more step fits: the decay starts
    at the next step and is that step, at min_lr. Before: 75 steps, 14 more than the time held,
    to keep the decay a fifth of the run."""
    current = replace(schedule(), warmup_steps=16, total_steps=161)
    planned = plan(current, 60, 1)
    assert planned.schedule.total_steps == 61 and decay_begins(planned.schedule) == 60
    assert planned.schedule(59) == LR and planned.schedule(60) == MIN_LR
    assert planned.notes == ("the decay moved to the next step, 60: the time holds no later start",)
    planned = plan(current, 60, 10).schedule  # ten fit: the decay is those ten
    assert decay_begins(planned) == 60 and planned(60) < LR and planned(69) == MIN_LR


def test_when_no_step_fits_the_run_takes_one_more_and_ends_decayed():
    planned = plan(schedule("cosine"), 3, -40)
    assert planned.schedule.total_steps == 4 and planned.schedule(3) == MIN_LR
    assert planned.notes[0] == "the time left holds no more steps: the run ends after the next"


def test_constant_is_planned_at_any_step_and_a_plan_never_reads_as_provisional():
    current = replace(schedule("constant"), warmup_steps=10, total_steps=500)
    assert decay_begins(current) is None
    assert plan(current, 400, 1000).schedule.total_steps == 1400  # no decay to keep
    # at its end a run is over: with slow steps every boundary re-plans, and each plan's "one
    # more step" would make the run endless
    assert plan(current, 500, 1000).schedule is current
    assert plan(current, 500, -3).schedule is current
    assert decay_begins(schedule("cosine", warmup=7, total=500)) == 7
    huge = plan(schedule("cosine"), 3, 10**15).schedule
    assert huge.total_steps == LONGEST_PLAN and not provisional(huge)


# --------------------------------------------------------------------- the rule's properties

KINDS = list(SCHEDULES)


def currents(rng: random.Random):
    """A schedule a plan may meet: provisional (a new run's, a checkpoint's before its first
    plan), an earlier plan's, or a fixed-steps checkpoint's; of every kind and warmup."""
    name = rng.choice(KINDS)
    warmup = rng.choice([0, 1, 2, 3, 5, 10, 50, 100, 400])
    total = rng.choice([PROVISIONAL_STEPS, rng.randint(1, 30), rng.randint(1, 3000)])
    fraction = rng.choice([0.05, 0.2, 0.5, 1.0])
    return schedule(name, warmup=warmup, total=total, decay_fraction=fraction)


def test_every_plan_ends_decayed_on_its_last_step_within_the_time_never_undoing_a_decay():
    """20,000 draws of a schedule, a step reached, the steps that fit and the flags: the plan
    takes one more step at least and no more than fit; its warmup ends by its last step, which
    runs at min_lr (every kind that decays); a decay that began stays begun, its step's lr the
    same (unless that step is the last); WSD's decay never starts before the step reached."""
    rng = random.Random(52)
    for _ in range(20_000):
        current = currents(rng)
        step = rng.randint(1, 3000)
        if not provisional(current):  # a checkpoint at its end or past it: Budget.start's
            step = min(step, current.total_steps - 1)
        fit = rng.choice([-5, 0, 1, 2, rng.randint(3, 50), rng.randint(50, 5000)])
        warmup = rng.choice([None, 0, 1, 3, 20, 300])
        fraction = rng.choice([None, 0.1, 0.2, 1.0])
        planned = plan(current, step, fit, warmup=warmup, decay_fraction=fraction).schedule
        total, case = planned.total_steps, (current, step, fit, warmup, fraction, planned)
        assert step + 1 <= total <= max(step + 1, step + fit), case
        assert planned.warmup_steps <= total - 1, case
        last = planned(total - 1)
        assert last == (MIN_LR if SCHEDULES[planned.name].decays else LR), case
        begins = None if provisional(current) else decay_begins(current)
        if begins is not None and step >= begins:  # the decay began: never undone
            assert decay_begins(planned) <= step and planned(step) <= current(step), case
            assert planned(step) == current(step) or total == step + 1, case
        elif planned.name == "wsd":
            assert decay_begins(planned) >= step, case


def test_a_run_replanned_at_every_step_ends_decayed_whatever_the_time_does():
    """Plans at every step, the steps that fit measured anew from a time left that each step
    spends at a pace that changes at random (0.2 to 5 units a step, the plan's estimate the last
    step's): every run ends, at min_lr, past the time by two steps at most (one slower than
    planned, then the one taken where none fits; or the three before the first plan and one),
    and its decay is never undone (the lr of each step after the decay began at most the one
    before)."""
    rng = random.Random(4)
    for name, warmup in itertools.product(KINDS, [None, 1, 3, 40]):
        for _ in range(40):
            current = schedule(name, warmup=warmup if warmup is not None else 100)
            left, step, lrs = rng.uniform(0, 400), 0, []
            for _ in range(100_000):
                lrs.append(current(step))
                pace = rng.choice([rng.uniform(0.2, 1), rng.uniform(1, 5)])
                left -= pace
                step += 1
                if step >= 3:
                    current = plan(current, step, math.floor(left / pace), warmup=warmup).schedule
                if step >= current.total_steps:
                    break
            assert step == current.total_steps  # it ended
            assert left > -10 or step == 4
            if SCHEDULES[name].decays:
                assert lrs[-1] == MIN_LR
                begins = next((k for k in range(3, len(lrs)) if lrs[k] < max(lrs[:k])), len(lrs))
                assert all(a >= b for a, b in zip(lrs[begins:], lrs[begins + 1 :]))
