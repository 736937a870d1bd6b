"""compile_plan.py: --compile auto's decision, a pure function of the device, the mode and the
planned run (on the CPU: a cold compile's estimate against the share of the run it saves)."""

import os
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from llama_ddp.distributed import compile_plan as C
from llama_ddp.distributed.compile_plan import PlannedRun, compile_choice
from llama_ddp.model.config import member, preset
from llama_ddp.train.config import TrainConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_estimates_are_the_measured_constants():
    """A cold compile: COMPILE_S + COMPILE_S_PER_LAYER a layer; the share saved falls as
    64 / width from d1's."""
    d1, d4 = PlannedRun(1, 64, 100.0), PlannedRun(4, 256, 100.0)
    assert d1.compile_s() == C.COMPILE_S + C.COMPILE_S_PER_LAYER
    assert d4.compile_s() == C.COMPILE_S + 4 * C.COMPILE_S_PER_LAYER
    assert d1.saved_share() == C.SAVED_AT_WIDTH_64
    assert d4.saved_share() == pytest.approx(C.SAVED_AT_WIDTH_64 / 4)
    assert PlannedRun(1, 32, 100.0).saved_share() == C.SAVED_AT_WIDTH_64  # no more than d1's


def test_on_the_cpu_auto_compiles_where_the_saving_repays_the_compile():
    """At the edge: a run whose saved share is thrice the compile's cost (`REPAY`) compiles, a
    second shorter one does not; the reason gives the estimate either way."""
    cost = PlannedRun(1, 64, 0.0).compile_s()
    assert C.REPAY == 3.0
    edge = C.REPAY * cost / C.SAVED_AT_WIDTH_64
    on, why = compile_choice(None, CPU, "single", PlannedRun(1, 64, edge, "600 steps"))
    assert on and why == (
        f"auto: on for the CPU: a cold compile of 1 layer ~{cost:.0f} s, saving ~{3 * cost:.0f} s "
        "(23% at width 64) of 600 steps (--no-compile turns it off)"
    )
    off, why = compile_choice(None, CPU, "single", PlannedRun(1, 64, edge - 1, "599 steps"))
    assert not off and why.startswith("auto: off for the CPU: a cold compile of 1 layer")
    assert why.endswith("of 599 steps (--compile turns it on)")
    assert compile_choice(None, CPU, "single", PlannedRun(1, 64, None)) == (
        False,
        "auto: off on the CPU for a run of unknown length (--compile turns it on)",
    )
    assert compile_choice(None, CPU, "single") == compile_choice(None, CPU, "ddp", None)
    assert compile_choice(True, CPU, "single", PlannedRun(1, 64, 1.0)) == (True, "--compile")
    assert compile_choice(False, CPU, "single", PlannedRun(1, 64, 1e9)) == (False, "--no-compile")


def test_cuda_and_dataparallel_are_as_before_whatever_the_run():
    for run in (None, PlannedRun(1, 64, 1.0), PlannedRun(1, 64, 1e9)):
        assert compile_choice(None, CUDA, "ddp", run) == (
            True,
            "auto: on for CUDA, one graph per decoder layer (--no-compile turns it off)",
        )
        on, why = compile_choice(None, CUDA, "dp", run)
        assert not on and "DataParallel" in why


def test_a_runs_length_is_its_steps_at_the_measured_eager_speed_or_its_budget():
    """make pretrain-small's recipe before issue 59 (d1, 600 steps of 16 x 256, vocab 8192), and
    today's (vocab 4096), stay eager (the first's ~74 s saved
    are under thrice the ~50-s compile), 2,000 of its steps compile, its first 20 do not, nor the
    tests' tiny runs; a --time-budget's seconds are the run's length: 10 minutes eager, 20
    compiled."""
    rt = SimpleNamespace(device=CPU, mode="single")
    d1 = member(1, vocab_size=8192)
    recipe = TrainConfig.from_flags(batch_size=16, seq_length=256)
    planned = PlannedRun.of_steps(d1, 600, 16, 256)
    step_s = 4096 * 3_661_824 / C.CPU_EAGER_FLOPS  # d1's training FLOPs a token at 256
    assert planned.seconds == pytest.approx(600 * step_s) and planned.layers == 1
    assert recipe.compiles(rt, d1, 600) == (
        False,
        "auto: off for the CPU: a cold compile of 1 layer ~50 s, saving ~74 s (23% at width 64) "
        "of 600 steps of ~0.54 s (--compile turns it on)",
    )
    assert not recipe.compiles(rt, member(1, vocab_size=4096), 600)[0]
    assert recipe.compiles(rt, d1, 2000)[0] and not recipe.compiles(rt, d1, 1200)[0]
    assert not recipe.compiles(rt, d1, 20)[0]
    tiny = TrainConfig.from_flags(batch_size=4, seq_length=32)
    assert not tiny.compiles(rt, preset("tiny", vocab_size=96), 8)[0]
    budget = TrainConfig.from_flags(time_budget="10m", batch_size=16, seq_length=256)
    assert not budget.compiles(rt, d1, 10**9)[0]  # 138 s saved, under 3 x 50
    budget = TrainConfig.from_flags(time_budget="20m", batch_size=16, seq_length=256)
    on, why = budget.compiles(rt, d1, 10**9)  # the provisional steps do not count
    assert on and 3 * PlannedRun(1, 64, 0.0).compile_s() <= 0.23 * 1200
    assert why.endswith("of the 1200 s budget (--no-compile turns it off)")
    assert not TrainConfig.from_flags(time_budget="60s").compiles(rt, d1, 10**9)[0]
    # resumed: what is left counts, its checkpoint's steps trained and budget seconds spent
    assert not recipe.compiles(rt, d1, 2000, {"step": 1500, "tokens": 0})[0]  # 500 left
    on, why = budget.compiles(rt, d1, 10**9, {"step": 9, "budget_spent_s": 900.0})
    assert not on and "of the 300 s budget" in why
    slurm = TrainConfig.from_flags(time_budget="slurm", batch_size=16, seq_length=256)
    end = {"SLURM_JOB_END_TIME": str(int(time.time()) + 1200)}  # the job's time left already
    with mock.patch.dict(os.environ, end):
        assert slurm.compiles(rt, d1, 10**9, {"step": 9, "budget_spent_s": 900.0})[0]
