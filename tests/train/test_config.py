"""config.py: every choice comes from its one registry; derived values."""

import typing

import pytest

from llama_ddp.distributed.parallelize import MODES
from llama_ddp.errors import UserError
from llama_ddp.model.config import PRESETS
from llama_ddp.precision import DTYPES
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.flags import literal_choices
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.optim import SCHEDULES


def test_each_choice_is_its_registry():
    hints = typing.get_type_hints(TrainConfig)
    assert literal_choices(hints["lr_schedule"]) == tuple(SCHEDULES)
    assert literal_choices(hints["mode"]) == ("auto", *MODES)
    assert literal_choices(hints["dtype"]) == ("auto", *DTYPES)
    assert literal_choices(hints["preset"]) == tuple(PRESETS)
    help_of = {f: TrainConfig.__dataclass_fields__[f].metadata["help"] for f in hints}
    assert all(name in help_of["lr_schedule"] for name in SCHEDULES)
    assert all(name in help_of["mode"] for name in MODES)
    assert all(name in help_of["log_to"] for name in SINKS)


def test_a_logger_is_checked_against_the_registry():
    with pytest.raises(UserError, match="--log-to 'csv' is not one of: tensorboard, wandb"):
        TrainConfig(log_to="csv").validate()
    assert TrainConfig(log_to="tensorboard, none").loggers() == ["tensorboard"]


def test_default_warmup():
    cfg = TrainConfig()
    assert cfg.warmup(10_000) == 100
    assert cfg.warmup(200) == 20
    assert cfg.warmup(5) == 1
    assert TrainConfig(warmup_steps=0).warmup(10_000) == 0
