"""train/sizing/auto.py's timing of a candidate: the step it times is the step the run takes (in
one process, within a factor of the run's own steps), at the run's micro-batch and accumulation,
compiled where the run compiles, and a candidate that runs out of memory on any rank is dropped
on every rank."""

import json
import re
import statistics
import subprocess

import pytest

from tests.helpers.runs import tiny_args, train_command

AGREE = 1.5  # the timed step against the run's own: at most this factor either way


def step_seconds(metrics) -> list[float]:
    """Each logged step's seconds (--log-every 1: a step's targets over its tokens per second),
    the first step (its first calls) left out."""
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in lines if "tokens_per_s" in r]
    return [
        (b["tokens"] - a["tokens"]) / b["tokens_per_s"]
        for a, b in zip(steps, steps[1:])
        if b["step"] == a["step"] + 1
    ]


@pytest.mark.e2e
def test_the_timed_step_is_the_step_the_run_takes_in_one_process(train_env, tmp_path):
    """One process at torch's own thread count (as a user runs it, no OMP_NUM_THREADS): the
    candidates were timed on batches read before their steps, in a process with no other thread,
    and took 3-6x the run's steps (d1: 1.93 s timed, 0.30-0.37 s trained); the run's loop steps
    with its prefetching thread beside it, as the timing now does."""
    args = tiny_args(train_env, tmp_path, "--dtype", "auto", "--optimizer", "muon",
                     "--lr-schedule", "wsd", "--seq-length", "128")  # fmt: skip
    at, steps = args.index("--preset"), args.index("--max-steps")
    args = [*args[:at], *args[at + 2 : steps], *args[steps + 2 :],
            "--model-size", "auto", "--time-budget", "75s", "--eval-tokens", "768"]  # fmt: skip
    env = {k: v for k, v in train_env["env"].items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        train_command(args),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    depth = re.search(r"model size: auto chose depth (\d+)", result.stdout)[1]
    timed = float(
        re.search(rf"a step timed of each candidate \([^)]*d{depth} (\S+) s", result.stdout)[1]
    )
    trained = statistics.median(step_seconds(tmp_path / "metrics.jsonl"))
    assert 1 / AGREE <= timed / trained <= AGREE, (timed, trained)
