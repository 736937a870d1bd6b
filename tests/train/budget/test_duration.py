"""train/budget/duration.py: --time-budget's durations and SLURM's time left, each bounded by
what a checkpoint keeps (schema.MAX_SECONDS); a wrong one is one line."""

import pytest

from llama_ddp.checkpoint.schema import MAX_SECONDS
from llama_ddp.errors import UserError
from llama_ddp.train.budget.duration import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("10m", 600.0), ("2h", 7200.0), ("1.5h", 5400.0), ("1000000000s", 1e9)],
)
def test_durations(text, seconds):
    assert parse_duration(text, {}, 0.0) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ten minutes", "--time-budget must be a duration such as 90s, 10m or 2h, got 'ten mi"),
        ("0s", "--time-budget must be a duration such as 90s, 10m or 2h, got '0s'"),
        # issue 52: 4.4e24 steps planned, whose checkpoints its own resume refused as damaged
        (
            "99999999999999999999h",
            "--time-budget 99999999999999999999h is longer than 1000000000 s (about 32 years), "
            "the longest a run keeps (give a duration such as 90s, 10m or 2h)",
        ),
        ("1000000001s", "--time-budget 1000000001s is longer than 1000000000 s"),
        ("9" * 400 + "s", "--time-budget 99999999999999999999... is longer than"),  # inf
    ],
)
def test_a_duration_that_no_run_can_have_is_one_line(text, message):
    with pytest.raises(UserError) as err:
        parse_duration(text, {}, 0.0)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_slurm_takes_the_jobs_time_left_less_a_margin():
    """180 s: train.sbatch's SIGTERM comes 120 s before the job's end, and a minute more."""
    env = {"SLURM_JOB_END_TIME": "11000"}
    assert parse_duration("slurm", env, 1000.0) == 10000 - 180
    assert parse_duration("slurm", env, 10800.0) == 200 - 180
    with pytest.raises(UserError, match="150 s left, no more than the 180 s kept .* too little"):
        parse_duration("slurm", env, 10850.0)
    with pytest.raises(UserError, match="needs SLURM_JOB_END_TIME, which is not set"):
        parse_duration("slurm", {}, 0.0)


@pytest.mark.parametrize("end", ["garbage", "nan", "inf", "-inf", "", " ", "1e400"])
def test_a_slurm_end_time_that_is_no_time_is_one_line(end):
    """Issue 52: garbage was a ValueError's traceback; nan and inf a NaN budget that failed at
    the first plan, after files were written."""
    with pytest.raises(UserError) as err:
        parse_duration("slurm", {"SLURM_JOB_END_TIME": end}, 1000.0)
    message = str(err.value)
    if end.strip():
        assert message == (
            f"SLURM_JOB_END_TIME={end} is not a Unix time in seconds (run inside a SLURM job, "
            "which sets it, or give a duration such as 2h)"
        )
    else:
        assert "needs SLURM_JOB_END_TIME, which is not set" in message


def test_a_slurm_job_that_ends_past_what_a_run_keeps_is_one_line():
    env = {"SLURM_JOB_END_TIME": str(3 * MAX_SECONDS)}
    with pytest.raises(UserError, match=r"^the SLURM job's time left, 3000000000 s, is longer"):
        parse_duration("slurm", env, 0.0)
