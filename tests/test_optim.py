import math

import pytest
import torch

from llama_ddp.config import TrainConfig, preset
from llama_ddp.model import LlamaForPretraining
from llama_ddp.optim import build_optimizer, lr_at, param_groups

S = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)


def test_schedule_starts_at_a_tenth_of_lr():
    assert lr_at(0, **S) == pytest.approx(1e-4, rel=1e-12)


def test_schedule_warmup_is_linear():
    assert lr_at(5, **S) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert lr_at(9, **S) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.9), rel=1e-12)


def test_schedule_peaks_at_end_of_warmup():
    assert lr_at(10, **S) == pytest.approx(1e-3, rel=1e-12)


def test_schedule_cosine_middle_and_end():
    assert lr_at(60, **S) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-12)
    quarter = 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25))
    assert lr_at(35, **S) == pytest.approx(quarter, rel=1e-12)
    assert lr_at(110, **S) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(500, **S) == pytest.approx(1e-4, rel=1e-12)


def test_schedule_is_monotonic_after_warmup():
    values = [lr_at(s, **S) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_default_warmup():
    cfg = TrainConfig()
    assert cfg.warmup(10_000) == 100
    assert cfg.warmup(200) == 20
    assert cfg.warmup(5) == 1
    assert TrainConfig(warmup_steps=0).warmup(10_000) == 0


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
