"""The time budget's plan (train/budget/plan.py), driven by a fake clock: no test here is timed
but the torchrun run's, which checks what the ranks did, not how long they took."""

import json
import re

import pytest

from llama_ddp.errors import UserError
from llama_ddp.train.budget.plan import Budget, decay_begins, parse_duration, resumed
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.optim import PROVISIONAL_STEPS, ScheduleState, make_schedule
from llama_ddp.train.trainer import TrainState
from tests.helpers.runs import run_train, tiny_args


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def warmup(total: int) -> int:  # ScheduleSettings.warmup's default
    return min(100, max(1, total // 10))


def provisional(name: str = "wsd"):
    return make_schedule(
        name, lr=1e-3, min_lr=1e-4, warmup_steps=100, total_steps=PROVISIONAL_STEPS
    )


def budget(clock: Clock, seconds: float = 100.0) -> Budget:
    # end: 5 s for the save and exports, 2 steps for the evaluation; margin 2 + 2% = 4 s;
    # re-plans at least 5 s apart (100 / 30 is less)
    return Budget(seconds, 0.0, 5.0, clock=clock, eval_steps=2.0, warmup=warmup)


def test_the_plan_fits_the_steps_measured_after_the_first_into_the_time_left():
    clock, schedule = Clock(), provisional()
    b = budget(clock)
    clock.now = 10.0  # start-up and the first step (compiling): paid, not timed
    assert b.plan(1, schedule) is schedule
    clock.now = 10.5
    assert b.plan(2, schedule) is schedule  # one timed step is not enough
    clock.now = 11.0
    planned = b.plan(3, schedule)
    # 0.5 s a step; 89 s left less 10 s kept (2 steps of evaluation 1 s, the end 5 s, margin
    # 4 s): 158 more steps
    assert b.step_time(3) == 0.5 and b.reserve(0.5) == 10.0
    assert planned.total_steps == 3 + 158
    assert planned.warmup_steps == 16  # set by the first plan: a tenth of the run
    assert decay_begins(planned, planned.total_steps) == 161 - 32  # wsd's last fifth
    assert planned.lr == schedule.lr and planned.name == "wsd"


def test_a_replan_moves_the_end_every_few_seconds_until_the_decay_and_never_after():
    clock, schedule = Clock(), provisional()
    b = budget(clock)
    for step, now in ((1, 10.0), (2, 10.5), (3, 11.0)):
        clock.now = now
        schedule = b.plan(step, schedule)
    assert schedule.total_steps == 161
    for step in range(4, 8):  # the machine got slower: 1 s a step from step 3 on
        clock.now = 11.0 + step - 3
        assert b.plan(step, schedule) is schedule  # at most 4 s after the plan: too soon
    clock.now = 16.0
    slower = b.plan(8, schedule)
    # the recent half (steps 4 to 8): 1 s a step (the mean since step 1, 0.86 s, would plan
    # 93); 84 s left less 11 s kept (evaluation 2 x 1 s, end 5 s, margin 4 s): 73 more steps
    assert b.step_time(8) == 1.0
    assert slower.total_steps == 81 and slower.warmup_steps == 16  # the warmup stays
    assert decay_begins(slower, 81) == 65
    clock.now = 90.0  # far slower still, but the decay began at step 65: the end stays
    assert b.plan(65, slower) is slower
    assert b.plan(70, slower) is slower


def test_the_step_time_follows_a_machine_that_got_faster():
    """A start slowed by another job (2 s a step), then 0.5 s a step: the plan after 40 steps
    takes the recent pace, so the run uses its time (the mean since the start, 0.875 s a step,
    would plan 43% fewer steps than fit and end that much early)."""
    clock, schedule = Clock(), provisional()
    b = Budget(300.0, 0.0, 5.0, clock=clock, eval_steps=2.0, warmup=warmup, replan_s=1e9)
    clock.now = 10.0
    b.plan(1, schedule)
    for step in range(2, 42):
        clock.now += 2.0 if step <= 11 else 0.5
        b.plan(step, schedule)
    assert b.step_time(41) == 0.5  # steps 21 to 41
    assert (clock.now - 10.0) / 40 == 0.875  # the mean since step 1


def test_a_shorter_plan_never_starts_its_decay_before_the_next_step():
    clock, schedule = Clock(), provisional()
    b = budget(clock)
    for step, now in ((1, 10.0), (2, 10.5), (3, 11.0)):
        clock.now = now
        schedule = b.plan(step, schedule)
    clock.now = 95.0  # at step 60, almost out of time: one more step would fit
    planned = b.plan(60, schedule)
    # the shortest run whose decay starts at step 60 or later: 75 - round(0.2 x 75) = 60
    assert planned.total_steps == 75 and decay_begins(planned, 75) == 60


def test_cosine_decays_from_the_warmup_end_and_constant_never_freezes_the_plan():
    cosine, constant = provisional("cosine"), provisional("constant")
    assert decay_begins(cosine, 500) == 100
    assert decay_begins(constant, 500) is None


def test_the_reserve_takes_the_measured_evaluation_and_twice_the_last_save():
    b = budget(Clock())
    assert b.reserve(1.0) == 2.0 + 5.0 + 4.0
    b.measured.update(eval=3.0, save=4.0)
    assert b.reserve(1.0) == 3.0 + 8.0 + 4.0


def test_a_resume_counts_the_time_its_checkpoint_spent():
    clock = Clock()
    first = TrainState(budget=budget(clock))
    clock.now = 60.0
    saved = first.state_dict()
    assert saved["budget_spent_s"] == 60.0
    later = Clock()
    second = TrainState(budget=Budget(100.0, 0.0, 5.0, clock=later, warmup=warmup))
    second.load_state_dict(saved)
    later.now = 10.0  # this process's start-up
    assert second.budget.elapsed() == 70.0 and second.budget.left() == 30.0
    schedule = ScheduleState(provisional())
    schedule.saved = make_schedule(
        "wsd", lr=1e-3, min_lr=1e-4, warmup_steps=16, total_steps=161, decay_fraction=0.2
    )
    assert resumed(second.budget, schedule) == 161  # the plan so far, re-planned from here
    assert schedule.current.total_steps == 161 and schedule.current.warmup_steps == 16
    assert second.budget.warmup is None  # its re-plans keep the first run's warmup
    later.now = 35.0  # 95 s of 100 spent: less than the end needs (9 s)
    with pytest.raises(UserError, match="time budget of 100 s is spent: the runs before"):
        resumed(second.budget, schedule)


def test_a_checkpoint_without_a_budget_counts_its_loops_seconds():
    state = TrainState(budget=Budget(100.0, 0.0, 5.0, clock=Clock()))
    state.load_state_dict({"step": 5, "tokens": 10, "seconds": {"train_s": 30.0, "eval_s": 2.5}})
    assert state.budget.spent_before == 32.5


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90.0), ("10m", 600.0), ("2h", 7200.0), ("1.5h", 5400.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text, {}, 0.0) == seconds


def test_slurm_takes_the_jobs_time_left_less_a_margin():
    env = {"SLURM_JOB_END_TIME": "11000"}
    assert parse_duration("slurm", env, 1000.0) == 10000 - 500  # 5 percent of 10,000 s
    assert parse_duration("slurm", env, 10800.0) == 200 - 60  # at least a minute
    with pytest.raises(UserError, match="too little to train"):
        parse_duration("slurm", env, 10950.0)
    with pytest.raises(UserError, match="needs SLURM_JOB_END_TIME, which is not set"):
        parse_duration("slurm", {}, 0.0)


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
def test_under_torchrun_every_rank_follows_rank_0s_plan_and_ends_at_the_schedules_end(
    train_env, tmp_path
):
    """DDP x2 (gloo) on a 25 s budget: the ranks train the steps of rank 0's last plan (one
    more or fewer on any rank would leave a collective unmatched), the last step at --min-lr
    (WSD's decay landed on it), then evaluate, save and export."""
    args = tiny_args(train_env, tmp_path, "--mode", "ddp", "--lr-schedule", "wsd")
    at = args.index("--max-steps")
    args = [*args[:at], *args[at + 2 :], "--time-budget", "25s", "--min-lr", "1e-5"]
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
