"""optim.py: the learning-rate schedules' exact values, a run's schedule, AdamW groups (Muon's
step and its share of the parameters: test_muon.py)."""

import math

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.train.muon import largest_step_scalar
from llama_ddp.train.optim import (
    OptimizerSettings,
    Schedule,
    ScheduleSettings,
    build_optimizer,
    build_schedule,
    lr_at,
    param_groups,
)

S = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)


def test_schedule_starts_at_a_tenth_of_lr():
    assert lr_at(0, **S) == pytest.approx(1e-4, rel=1e-12)


def test_schedule_warmup_is_linear():
    assert lr_at(5, **S) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert lr_at(9, **S) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.9), rel=1e-12)


def test_schedule_peaks_at_end_of_warmup():
    assert lr_at(10, **S) == pytest.approx(1e-3, rel=1e-12)


def test_schedule_cosine_middle_and_end():
    """From lr at the warmup's end (step 10) to min_lr at the last step (109): 99 intervals."""
    assert lr_at(43, **S) == pytest.approx(1e-4 + 0.5 * 9e-4 * 1.5, rel=1e-12)  # a third: cos 0.5
    assert lr_at(76, **S) == pytest.approx(1e-4 + 0.5 * 9e-4 * 0.5, rel=1e-12)  # two thirds
    assert lr_at(108, **S) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 98 / 99)))
    assert lr_at(109, **S) == 1e-4  # the last step runs at min_lr (issue 52: it ran at 1.0002e-4)
    assert lr_at(500, **S) == 1e-4


def test_cosine_and_linear_reach_min_lr_on_the_last_step_of_short_runs():
    """A 5-step run (warmup 1, the default for it): the last step, step 4, at --min-lr, as
    --help says; before, 6.71e-4 for cosine and 5.5e-4 for linear."""
    short = dict(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=5)
    assert [lr_at(s, **short) for s in range(5)] == pytest.approx(
        [1e-4, 1e-3, 1e-4 + 4.5e-4 * 1.5, 1e-4 + 4.5e-4 * 0.5, 1e-4], rel=1e-12
    )
    assert [lr_at(s, schedule="linear", **short) for s in range(5)] == pytest.approx(
        [1e-4, 1e-3, 7e-4, 4e-4, 1e-4], rel=1e-12
    )
    last = dict(short, warmup_steps=4)  # the warmup's end is the last step: straight to min_lr
    assert lr_at(3, **last) < 1e-3 and lr_at(4, **last) == lr_at(4, schedule="linear", **last)
    assert lr_at(4, **last) == 1e-4


def test_schedule_is_monotonic_after_warmup():
    values = [lr_at(s, **S) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_holds_then_decays_over_the_last_fifth():
    wsd = dict(S, schedule="wsd", decay_fraction=0.2)  # 22 decay steps: 88 ... 109
    assert lr_at(0, **wsd) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(9, **wsd) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.9), rel=1e-12)
    assert lr_at(10, **wsd) == 1e-3
    assert lr_at(87, **wsd) == 1e-3  # the last stable step
    assert lr_at(88, **wsd) == pytest.approx(1e-3 - 9e-4 / 22, rel=1e-12)
    assert lr_at(98, **wsd) == pytest.approx(1e-3 - 9e-4 * 11 / 22, rel=1e-12)
    assert lr_at(108, **wsd) == pytest.approx(1e-3 - 9e-4 * 21 / 22, rel=1e-12)
    assert lr_at(109, **wsd) == 1e-4  # the last step runs at min_lr
    assert lr_at(500, **wsd) == 1e-4


def test_wsd_keeps_its_lrs_before_the_decay_when_the_run_grows():
    short = Schedule("wsd", 1e-3, 1e-4, warmup_steps=10, total_steps=110, decay_fraction=0.2)
    long = Schedule("wsd", 1e-3, 1e-4, warmup_steps=10, total_steps=220, decay_fraction=0.2)
    assert (short.decay_start(), long.decay_start()) == (88, 176)
    assert [short(s) for s in range(88)] == [long(s) for s in range(88)]
    assert long(175) == 1e-3 and long(176) < 1e-3


def test_wsd_decays_at_least_one_step_and_never_inside_the_warmup():
    short = Schedule("wsd", 1e-3, 0.0, warmup_steps=0, total_steps=4, decay_fraction=0.1)
    assert [short(s) for s in range(5)] == [1e-3, 1e-3, 1e-3, 0.0, 0.0]  # 0.4 steps: one
    whole = dict(S, schedule="wsd", decay_fraction=1.0)  # the decay starts when warmup ends
    assert lr_at(9, **whole) < 1e-3
    assert lr_at(10, **whole) == pytest.approx(1e-3 - 9e-4 / 100, rel=1e-12)


def test_linear_decays_from_the_end_of_warmup_to_min_lr():
    linear = dict(S, schedule="linear")
    assert lr_at(0, **linear) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(10, **linear) == 1e-3
    assert lr_at(43, **linear) == pytest.approx(7e-4, rel=1e-12)  # a third of 99 intervals
    assert lr_at(108, **linear) == pytest.approx(1e-3 - 9e-4 * 98 / 99, rel=1e-12)
    assert lr_at(109, **linear) == 1e-4  # the last step
    assert lr_at(500, **linear) == 1e-4


def test_constant_holds_lr_after_warmup():
    constant = dict(S, schedule="constant")
    assert lr_at(0, **constant) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(5, **constant) == pytest.approx(5.5e-4, rel=1e-12)
    assert lr_at(10, **constant) == lr_at(110, **constant) == lr_at(10**6, **constant) == 1e-3


def test_a_runs_schedule_is_built_from_its_settings():
    cfg = ScheduleSettings(min_lr=2e-4, lr_schedule="wsd", decay_fraction=0.5)
    # warmup: a tenth of the run (at most 100 steps), unless --warmup-steps says otherwise
    assert build_schedule(cfg, 2e-3, 40) == Schedule("wsd", 2e-3, 2e-4, 4, 40, 0.5)
    assert build_schedule(cfg, 2e-3, 5000).warmup_steps == 100
    cfg = ScheduleSettings(lr_schedule="cosine", warmup_steps=7, decay_fraction=0.5)
    schedule = build_schedule(cfg, 4e-3, 40)
    assert (schedule.warmup_steps, schedule.decay_fraction) == (7, None)  # cosine has no decay
    assert schedule(39) == cfg.min_lr  # the last step


def test_norms_are_not_decayed():
    model = LlamaForPretraining(preset("tiny", vocab_size=50))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    n_norms = 2 * model.config.num_hidden_layers + 1
    assert len(no_decay["params"]) == n_norms
    assert len(decay["params"]) + n_norms == len(list(model.parameters()))


def test_adamw_defaults():
    model = LlamaForPretraining(preset("tiny", vocab_size=50))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.99) and group["eps"] == 1e-8


def test_a_learning_rate_that_overflows_float32_is_refused():
    """The step's scalars are float32 on the device: lr 1e308 was a RuntimeError deep in Muon's
    _foreach_add_. Every float setting must fit a float32; --lr with what the step multiplies
    it by (Muon's shape factor up to 819.2, 1 / (1 - 0.95), weight decay above 1) too."""
    assert largest_step_scalar(1.0, 0.9, 0.1) == pytest.approx(819.2 / 0.05)
    assert largest_step_scalar(1.0, 0.99, 2.0) == pytest.approx(2 * 819.2 / 0.01)
    OptimizerSettings(lr=1e30).validate()  # diverges (a non-finite loss, exit 1), but computes
    with pytest.raises(UserError, match=r"^--lr 1e\+308 does not fit a float32"):
        OptimizerSettings(lr=1e308).validate()
    with pytest.raises(UserError, match=r"^--lr 1e\+36 overflows a float32 in the optimizer's"):
        OptimizerSettings(lr=1e36).validate()
    with pytest.raises(UserError, match=r"^--weight-decay 1e\+39 does not fit a float32"):
        OptimizerSettings(weight_decay=1e39).validate()
    with pytest.raises(UserError, match=r"^--min-lr -1e\+39 does not fit a float32"):
        ScheduleSettings(min_lr=-1e39).validate()
