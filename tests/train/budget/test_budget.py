"""The time budget's owner (train/budget/budget.py), driven by a fake clock: when it plans, what
it keeps for the end, how a run starts and resumes under it, and whole runs simulated over
budgets, warmups, schedules and resumes. No test here is timed but the torchrun run's, which
checks what the ranks did, not how long they took."""

import contextlib
import json
import math
import os
import random
import re
import signal
from dataclasses import replace

import pytest

from llama_ddp.errors import UserError
from llama_ddp.train.budget.budget import Budget
from llama_ddp.train.budget.plan import decay_begins, provisional
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.optim import PROVISIONAL_STEPS, SCHEDULES, ScheduleState, make_schedule
from llama_ddp.train.trainer import TrainState
from tests.helpers.runs import run_train, tiny_args, train_here

LR, MIN_LR = 1e-3, 1e-4


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def deadline(seconds: float):
    """A TimeoutError in this thread after ``seconds``: a hang fails the test, never the suite."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def provisional_schedule(name: str = "wsd", warmup: int = 100) -> ScheduleState:
    return ScheduleState(
        make_schedule(
            name, lr=LR, min_lr=MIN_LR, warmup_steps=warmup, total_steps=PROVISIONAL_STEPS
        )
    )


def budget(clock: Clock, seconds: float = 100.0, **kw) -> Budget:
    # end: 5 s for the save and exports, 2 steps for the evaluation; margin 2 + 2% = 4 s;
    # re-plans at least 5 s apart (100 / 30 is less)
    return Budget(seconds, 0.0, 5.0, clock=clock, eval_steps=2.0, decay_fraction=0.2, **kw)


def follow(b: Budget, schedule: ScheduleState, clock: Clock, times: list[tuple[int, float]]):
    """Steps ending at the clock readings given, their plans followed; the plan lines."""
    lines = []
    for step, now in times:
        clock.now = now
        if (plan := b.after_step(step, schedule.current)) is not None:
            schedule.current = plan.schedule
            lines.append(plan.line)
    return lines


def test_the_plan_fits_the_steps_measured_after_the_first_into_the_time_left():
    clock, schedule = Clock(), provisional_schedule()
    b = budget(clock)
    assert follow(b, schedule, clock, [(1, 10.0), (2, 10.5)]) == []  # first step: not timed
    (line,) = follow(b, schedule, clock, [(3, 11.0)])
    # 0.5 s a step; 89 s left less 10 s kept (2 steps of evaluation 1 s, the end 5 s, margin
    # 4 s): 158 more steps; the warmup a tenth of them; WSD's last fifth decays
    assert b.step_time(3) == 0.5 and b.reserve(0.5) == 10.0 and b.fit(0.5) == 158
    planned = schedule.current
    assert (planned.total_steps, planned.warmup_steps, decay_begins(planned)) == (161, 16, 129)
    assert line == (
        "time budget: plan: 161 steps (0.00M tokens) at 0.500 s a step, 89 s left, 10.0 s kept "
        "for the end (evaluation, save, exports), warmup 16, decay from step 129"
    )


def test_a_replan_moves_the_end_before_the_decay_and_steepens_a_decay_that_began():
    clock, schedule = Clock(), provisional_schedule()
    b = budget(clock)
    follow(b, schedule, clock, [(1, 10.0), (2, 10.5), (3, 11.0)])
    assert schedule.current.total_steps == 161
    # the machine got slower: 1 s a step from step 3 on; at most 4 s after the plan: too soon
    assert follow(b, schedule, clock, [(s, 11.0 + s - 3) for s in range(4, 8)]) == []
    (line,) = follow(b, schedule, clock, [(8, 16.0)])
    # the recent half (steps 4 to 8): 1 s a step (the mean since step 1, 0.86 s, would plan
    # 93); 84 s left less 11 s kept (evaluation 2 x 1 s, end 5 s, margin 4 s): 73 more steps
    assert b.step_time(8) == 1.0 and line.startswith("time budget: re-planned at step 8: 81 steps")
    slower = schedule.current
    assert (slower.total_steps, slower.warmup_steps, decay_begins(slower)) == (81, 16, 65)
    # steps 9 to 70 at 1 s: the decay began at step 65, the end holds: no re-plan
    assert follow(b, schedule, clock, [(s, 16.0 + s - 8) for s in range(9, 71)]) == []
    # far slower still at step 71 (the last steps at 4 s): the decay ends sooner, from its lr
    (line,) = follow(b, schedule, clock, [(71, 102.0)])
    assert schedule.current.total_steps < 81 and decay_begins(schedule.current) <= 71
    assert line.endswith("its decay began at step 65: now steeper, to end sooner")
    assert schedule.current(schedule.current.total_steps - 1) == MIN_LR


def test_the_step_time_follows_a_machine_that_got_faster():
    """A start slowed by another job (2 s a step), then 0.5 s a step: the plan after 40 steps
    takes the recent pace, so the run uses its time (the mean since the start, 0.875 s a step,
    would plan 43% fewer steps than fit and end that much early)."""
    clock, schedule = Clock(10.0), provisional_schedule()
    b = Budget(300.0, 0.0, 5.0, clock=clock, eval_steps=2.0, replan_s=1e9)
    b.after_step(1, schedule.current)
    for step in range(2, 42):
        clock.now += 2.0 if step <= 11 else 0.5
        b.after_step(step, schedule.current)
    assert b.step_time(41) == 0.5  # steps 21 to 41
    assert (clock.now - 10.0) / 40 == 0.875  # the mean since step 1


def test_the_reserve_takes_the_measured_evaluation_and_twice_the_last_save():
    b = budget(Clock())
    assert b.reserve(1.0) == 2.0 + 5.0 + 4.0
    b.after_step(1, provisional_schedule().current)  # evaluations after the first step
    b.report("eval", 3.0)
    b.report("save", 4.0)
    assert b.reserve(1.0) == 3.0 + 8.0 + 4.0


def test_a_short_first_plan_ends_instead_of_hanging():
    """Issue 52, item 1: --time-budget 10s on the tiny preset (4 s of start-up, 0.2 s steps,
    1 s for the end and its margin of 2.2 s) planned 7 steps, and the loop that moved the total
    past a decay starting at the warmup's end (a tenth of the run: 0 < step 3) never ended.
    Now 7 steps, the last at min_lr, in well under the deadline."""
    clock, schedule = Clock(4.0), provisional_schedule("cosine")
    b = Budget(10.0, 0.0, 1.0, clock=clock)
    with deadline(5):
        lines = follow(b, schedule, clock, [(1, 5.0), (2, 5.2), (3, 5.4)])
    assert lines[0].startswith("time budget: plan: 7 steps (0.00M tokens) at 0.200 s a step,")
    assert schedule.current(6) == MIN_LR and schedule.current.warmup_steps == 1


def test_a_warmup_of_one_step_is_planned_and_the_budget_kept():
    """Issue 52, item 2: --time-budget 15s --warmup-steps 1 found the decay begun at the first
    plan and planned nothing: 10^9 steps, "time left -30 s", lr at its peak until killed."""
    clock, schedule = Clock(4.0), provisional_schedule("cosine", warmup=1)
    b = Budget(15.0, 0.0, 1.0, clock=clock, warmup=1)
    (line,) = follow(b, schedule, clock, [(1, 5.0), (2, 5.5), (3, 6.0)])
    # 9 s left less 4.3 s kept (evaluation 2 x 0.5 s, end 1 s, margin 2.3 s): 9 more steps
    assert schedule.current.total_steps == 12 and schedule.current.warmup_steps == 1
    assert schedule.current(11) == MIN_LR and "warmup 1, decay from step 1" in line


def test_a_constant_run_whose_steps_outlast_its_replans_still_ends():
    """Steps of 8 s, re-plans every 5 s: every boundary re-plans, and each plan took one more
    step at least, so a run out of time never reached its end (before: with constant alone).
    At step 3 (25 s): 35 s left less 20.2 s kept (evaluation 2 x 8 s, end 1 s, margin 3.2 s):
    one more step; at step 4 the run is over."""
    clock, schedule = Clock(1.0), provisional_schedule("constant", warmup=1)
    b = Budget(60.0, 0.0, 1.0, clock=clock, warmup=1)
    step = 0
    with deadline(5):
        while step < schedule.current.total_steps:
            step += 1
            follow(b, schedule, clock, [(step, 1.0 + 8.0 * step)])
    assert step == schedule.current.total_steps == 4 and clock.now == 33.0


# --------------------------------------------------------------------- starting and resuming


def test_a_budget_that_holds_no_step_is_refused_before_training():
    """Issue 52, item 6: --time-budget 1s ran ~6 s, exit 0, "-2 s left"."""
    clock = Clock(5.3)  # the start-up
    b = Budget(1.0, 0.0, 1.0, clock=clock)
    with pytest.raises(UserError) as err:
        b.start(provisional_schedule(), 0)
    assert str(err.value) == (
        "the time budget of 1 s holds no step: the start-up took 5.3 s of it and the end (the "
        "last evaluation, save and exports) needs about 3 s (give a larger --time-budget)"
    )
    b.seconds = 8.4  # 3.1 s left: more than the end's 3.2 s? no
    with pytest.raises(UserError, match="the time budget of 8.4 s holds no step"):
        b.start(provisional_schedule(), 0)
    b.seconds = 8.6
    assert b.start(provisional_schedule(), 0) == []
    b.share = lambda spent: True  # under torchrun rank 0's clock decides, or ranks would part
    with pytest.raises(UserError, match="the time budget of 8.6 s holds no step"):
        b.start(provisional_schedule(), 0)


def test_a_resume_counts_the_time_its_checkpoint_spent():
    clock = Clock()
    first = TrainState(budget=budget(clock))
    clock.now = 60.0
    saved = first.state_dict()
    assert saved["budget_spent_s"] == 60.0
    later = Clock()
    second = TrainState(budget=budget(later))
    second.load_state_dict(saved)
    later.now = 10.0  # this process's start-up
    assert second.budget.elapsed() == 70.0 and second.budget.left() == 30.0
    schedule = provisional_schedule()
    schedule.saved = make_schedule(
        "wsd", lr=LR, min_lr=MIN_LR, warmup_steps=16, total_steps=161, decay_fraction=0.2
    )
    assert second.budget.start(schedule, 40) == []  # the plan so far, re-planned from here
    assert schedule.current == schedule.saved
    later.now = 35.0  # 95 s of 100 spent: less than the end needs (9 s)
    with pytest.raises(UserError, match="time budget of 100 s is spent: the runs before"):
        second.budget.start(schedule, 40)


def test_a_checkpoint_without_a_budget_counts_its_loops_seconds():
    state = TrainState(budget=Budget(100.0, 0.0, 5.0, clock=Clock()))
    state.load_state_dict({"step": 5, "tokens": 10, "seconds": {"train_s": 30.0, "eval_s": 2.5}})
    assert state.budget.spent_before == 32.5


def test_a_checkpoint_before_its_first_plan_is_planned_as_a_new_run():
    """Issue 52, item 3: stopped after step 1, the checkpoint kept the provisional warmup of
    100; the resumed run planned 82 steps "decay from step 100" and ended at lr 3.3e-3."""
    clock = Clock(3.0)
    b = Budget(60.0, 0.0, 1.0, clock=clock, spent_before=4.0)
    schedule = provisional_schedule("cosine")
    schedule.saved = schedule.current
    assert b.start(schedule, 1) == []
    follow(b, schedule, clock, [(2, 4.0), (3, 4.5), (4, 5.0)])
    assert schedule.current.warmup_steps == schedule.current.total_steps // 10
    assert schedule.current(schedule.current.total_steps - 1) == MIN_LR


def test_a_checkpoint_at_its_end_says_it_is_finished():
    """Issue 52, item 6: a finished run resumed with a larger budget trained 0 steps and said
    nothing (the spent budget's line had advised the larger budget)."""
    b = Budget(1000.0, 0.0, 1.0, clock=Clock(3.0), spent_before=990.0)  # spent: not refused
    schedule = provisional_schedule("wsd")
    schedule.saved = replace(schedule.current, warmup_steps=8, total_steps=82)
    assert b.start(schedule, 82) == [
        "note: the checkpoint at step 82 is its run's end (the last step of its wsd schedule): "
        "nothing is left to train, and a larger --time-budget does not extend a finished run (to "
        "train on, start a new one in another --out-dir with --init-from this one's "
        "llama_model.pth)"
    ]
    assert schedule.current.total_steps == 82


# --------------------------------------------------------------------- whole runs, simulated


def simulate(rng: random.Random) -> None:
    """One run under a fake clock, drawn at random: a budget, start-up, step time (steady, or
    slower or faster part-way), schedule, warmup flag, and maybe a stop and a resume (the second
    process paying its own start-up). It ends; its last step runs at min_lr (every kind that
    decays); each plan fits the time left (or takes one step where none fits); a run whose step
    time never changed ends within its budget, its evaluation and save included."""
    seconds, step_s = rng.choice(
        [(5.0, 0.2), (5.0, 1.0), (20.0, 0.2), (20.0, 7.0), (60.0, 0.05), (60.0, 1.0),
         (600.0, 0.5), (600.0, 7.0), (3600.0, 2.0), (3600.0, 30.0)]
    )  # fmt: skip
    name = rng.choice(list(SCHEDULES))
    flag = rng.choice([None, 0, 1, 3, 10, 200])
    change = rng.choice([1.0, 1.0, 0.3, 3.0])  # the step time's factor after a third of it
    stop = rng.choice([None, None, 1, 2, 5, 40])
    eval_s, end_s = 2 * step_s, 1.0  # as the budget estimates them: the run's real end
    clock = Clock(rng.uniform(1.0, 8.0))
    b = Budget(seconds, 0.0, end_s, clock=clock, eval_steps=2.0, warmup=flag, decay_fraction=0.2)
    schedule = provisional_schedule(name, warmup=100 if flag is None else flag)
    step, lrs, resumed = 0, [], False

    def start(step: int) -> bool:
        try:
            b.start(schedule, step)
            return True
        except UserError:
            assert b.left() <= b.reserve(0.0)
            return False

    if not start(0):
        return
    first_step = step
    for _ in range(10**6):
        if step >= schedule.current.total_steps:
            break
        lrs.append(schedule.current(step))
        pace = step_s * (change if clock.now > seconds / 3 else 1.0)
        clock.now += pace * (3 if step == first_step else 1)  # compiling
        step += 1
        if (plan := b.after_step(step, schedule.current)) is not None:
            planned = plan.schedule
            spare = (
                b.left()
                - b.reserve(b.step_time(step))
                - (planned.total_steps - step) * (b.step_time(step))
            )
            assert spare >= -1e-6 * seconds or planned.total_steps <= step + 1, plan.line
            schedule.current = planned
        if stop is not None and step == stop:  # a stop and a resume in a new process
            saved, spent = schedule.current, b.elapsed()
            clock = Clock(rng.uniform(1.0, 8.0))
            b = Budget(seconds, 0.0, end_s, clock=clock, eval_steps=2.0, warmup=flag,
                       decay_fraction=0.2, spent_before=spent)  # fmt: skip
            schedule = provisional_schedule(name, warmup=100 if flag is None else flag)
            schedule.saved, stop, first_step, resumed = saved, None, step, True
            if not start(step):
                return
    else:
        raise AssertionError("the run never ended")
    assert step == schedule.current.total_steps and not provisional(schedule.current)
    if SCHEDULES[name].decays:
        assert lrs[-1] == MIN_LR
    if change == 1.0 and not resumed and len(lrs) > 4:  # planned on steady steps
        assert b.elapsed() + eval_s + end_s <= seconds - b.margin() + 1e-6 * seconds


def test_simulated_runs_end_decayed_within_their_budget():
    rng = random.Random(46)
    with deadline(60):
        for _ in range(400):
            simulate(rng)


# --------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-steps", "5"], "--time-budget plans the run's length: drop --max-steps"),
        (["--epochs", "2"], "--time-budget plans the run's length: drop --epochs"),
        (["--time-budget", "ten minutes"], "must be a duration such as 90s, 10m or 2h"),
        (["--time-budget", "0s"], "must be a duration such as 90s, 10m or 2h"),
    ],
)
def test_refusals(flags, message, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    with pytest.raises(UserError, match=message):
        parse_train_args(["--preset", "tiny", "--time-budget", "10m", *flags])


def test_a_toml_file_sets_the_budget(tmp_path):
    (tmp_path / "run.toml").write_text('preset = "tiny"\ntime-budget = "90s"\n')
    cfg = parse_train_args(["--config", str(tmp_path / "run.toml")])
    assert cfg.schedule.time_budget == "90s" and cfg.schedule.total_steps(None) == PROVISIONAL_STEPS
    assert not cfg.schedule.sized()


@pytest.mark.e2e
@pytest.mark.alone
def test_under_torchrun_every_rank_follows_rank_0s_plan_and_ends_at_the_schedules_end(
    train_env, tmp_path
):
    """DDP x2 (gloo) on a 30 s budget: the ranks train the steps of rank 0's last plan (one
    more or fewer on any rank would leave a collective unmatched), the last step at --min-lr
    (WSD's decay landed on it), then evaluate, save and export. (On 2 loaded cores torchrun's
    start-up took 25 s: a budget that holds no step after it is refused.)"""
    args = tiny_args(train_env, tmp_path, "--mode", "ddp", "--lr-schedule", "wsd")
    at = args.index("--max-steps")
    args = [*args[:at], *args[at + 2 :], "--time-budget", "20s", "--min-lr", "1e-5"]
    result = run_train(train_env, args, ["--standalone", "--nproc_per_node=2"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    plans = re.findall(r"time budget: (?:plan|re-planned at step \d+): (\d+) steps", result.stdout)
    assert plans, result.stdout[-2000:]
    total = int(plans[-1])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["step"] == total and steps[-1]["lr"] == pytest.approx(1e-5)
    assert [r["step"] for r in records if "val_bpb" in r][-1] == total
    assert (tmp_path / "checkpoints" / f"step-{total:08d}").is_dir()
    assert (tmp_path / "llama_model.pth").is_file()
    assert math.isfinite(steps[-1]["loss"])


# --------------------------------------------------------------------- runs, in this process


class RunClock(Clock):
    """The budget's clock of a run in this process: 2 s of start-up, then ``step_s`` a step
    (the fault hook moves it after each), so its plans are the same on any machine."""

    def __init__(self, step_s: float, stop_after: int | None = None) -> None:
        super().__init__(0.0)
        self.step_s, self.stop_after = step_s, stop_after

    def hook(self, point: str, step: int) -> None:
        if point != "after-step":
            return
        self.now += self.step_s
        if step == self.stop_after:  # a job's time limit: SIGTERM, saved at this step
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def budget_run(train_env, tmp_path, monkeypatch, capsys):
    """run(cfg) of the tiny preset with these flags and a `RunClock`: (exit code, stdout, the
    metrics lines of the steps)."""
    from llama_ddp.train import run as run_module
    from llama_ddp.train.budget import budget as budget_module

    monkeypatch.setattr(run_module, "process_age", lambda: 2.0)

    def train(*flags: str, step_s: float = 1.0, stop_after: int | None = None):
        clock = RunClock(step_s, stop_after)
        monkeypatch.setattr(budget_module, "CLOCK", clock)
        args = tiny_args(train_env, tmp_path, "--eval-tokens", "768", *flags)
        if "--time-budget" in flags:
            at = args.index("--max-steps")
            args = [*args[:at], *args[at + 2 :]]
        cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
        code = run_module.run(cfg, fault=clock.hook)
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
        return code, capsys.readouterr().out, [r for r in records if "loss" in r]

    return train


def planned_total(stdout: str) -> int:
    return int(re.findall(r"time budget: (?:plan|re-planned at step \d+): (\d+) steps", stdout)[-1])


@pytest.mark.e2e
def test_a_budget_run_stopped_before_its_plan_resumes_to_a_decayed_end(budget_run):
    """Issue 52, item 3: stopped by SIGTERM after step 1 and run again, it planned with the
    checkpoint's provisional warmup of 100 and ended undecayed (lr 3.3e-3, exit 0). Then, run
    again with a larger budget (issue 52, item 6): the finished run says so, trains nothing."""
    code, _, _ = budget_run("--time-budget", "40s", stop_after=1)
    assert code == signal.SIGTERM
    code, out, steps = budget_run("--time-budget", "40s")
    total = planned_total(out)
    assert code == 0 and 10 < total < 40 and f"warmup {max(1, total // 10)}," in out
    assert steps[-1]["step"] == total and steps[-1]["lr"] == MIN_LR
    # each line's lr is the one its step ran at: step 4's the provisional warmup's, though
    # the plan after it set a warmup of 3 (it said the new schedule's 1e-3)
    assert {r["step"]: r["lr"] for r in steps}[4] == pytest.approx(1e-3 * (0.1 + 0.9 * 3 / 100))
    code, out, again = budget_run("--time-budget", "90s")
    assert code == 0 and again == steps
    assert f"note: the checkpoint at step {total} is its run's end" in out


@pytest.mark.e2e
def test_a_fixed_steps_checkpoint_past_its_warmup_keeps_to_the_budget(budget_run):
    """Issue 52, item 2: a 30-step cosine run (warmup 3) stopped at step 10 and resumed with
    --time-budget 20s ran on to its step 30 with no word. Now its decay gets steeper and the
    run ends where the time does, at min_lr."""
    code, _, _ = budget_run("--max-steps", "30", "--lr-schedule", "cosine", stop_after=10)
    assert code == signal.SIGTERM
    code, out, steps = budget_run("--time-budget", "20s", "--lr-schedule", "cosine")
    total = planned_total(out)
    assert code == 0 and "its decay began at step 3: now steeper, to end sooner" in out
    assert 13 < total < 30 and steps[-1]["step"] == total and steps[-1]["lr"] == MIN_LR


@pytest.mark.e2e
def test_a_budget_smaller_than_the_start_up_is_one_line_before_training(
    train_env, tmp_path, monkeypatch
):
    """Issue 52, item 6: --time-budget 1s ran about 6 s, exit 0, "-2 s left"."""
    from llama_ddp.train import run as run_module

    monkeypatch.setattr(run_module, "process_age", lambda: 5.0)
    args = tiny_args(train_env, tmp_path, "--time-budget", "1s")
    at = args.index("--max-steps")
    result = train_here(train_env, [*args[:at], *args[at + 2 :]])
    assert result.returncode == 2
    assert re.fullmatch(
        r"error: the time budget of 1 s holds no step: the start-up took 5\.\d s of it and the "
        r"end \(the last evaluation, save and exports\) needs about \d+ s \(give a larger "
        r"--time-budget\)\n",
        result.stderr,
    ), result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_constant_plan_says_it_has_no_decay():
    """Issue 60, item 12: a constant schedule's plan line said "decay from step None"."""
    clock, schedule = Clock(), provisional_schedule("constant", warmup=0)
    (line,) = follow(budget(clock), schedule, clock, [(1, 10.0), (2, 10.5), (3, 11.0)])
    assert line.endswith(", warmup 16, no decay")
