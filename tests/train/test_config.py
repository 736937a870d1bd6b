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
from llama_ddp.train.optim import OPTIMIZERS, SCHEDULES


def test_each_choice_is_its_registry():
    hints = typing.get_type_hints(TrainConfig)
    assert literal_choices(hints["lr_schedule"]) == tuple(SCHEDULES)
    assert literal_choices(hints["mode"]) == ("auto", *MODES)
    assert literal_choices(hints["dtype"]) == ("auto", *DTYPES)
    assert literal_choices(hints["preset"]) == tuple(PRESETS)
    assert literal_choices(hints["optimizer"]) == tuple(OPTIMIZERS)
    help_of = {f: TrainConfig.__dataclass_fields__[f].metadata["help"] for f in hints}
    assert all(name in help_of["lr_schedule"] for name in SCHEDULES)
    assert all(name in help_of["mode"] for name in MODES)
    assert all(name in help_of["log_to"] for name in SINKS)
    assert all(name in help_of["optimizer"] for name in OPTIMIZERS)


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


def test_the_optimizer_and_its_lr_are_settled_before_the_run_starts():
    """Muon by default, in every mode (FSDP too); AdamW for --init-from (the optimizer an open
    model was trained with); the checkpoint's when a run resumes; each with its own default lr
    unless --lr is given."""
    settled = TrainConfig().validate().settle()
    assert (settled.optimizer, settled.lr) == ("muon", OPTIMIZERS["muon"].lr)
    assert (settled.optimizer, settled.lr) == ("muon", 4e-3)
    fsdp = TrainConfig(mode="fsdp").validate().settle()
    assert (fsdp.optimizer, fsdp.lr) == ("muon", 4e-3)
    continued = TrainConfig(init_from="some/model", tokenizer="some/model").settle()
    assert (continued.optimizer, continued.lr) == ("adamw", 1e-3)
    told_muon = TrainConfig(init_from="some/model", optimizer="muon").settle()
    assert (told_muon.optimizer, told_muon.lr) == ("muon", 4e-3)
    resumed = TrainConfig().validate().settle(saved_optimizer="adamw")
    assert (resumed.optimizer, resumed.lr) == ("adamw", 1e-3)
    told = TrainConfig(optimizer="adamw", lr=3e-4).validate().settle(saved_optimizer="muon")
    assert (told.optimizer, told.lr) == ("adamw", 3e-4)  # a resume with it is refused later
    assert told.settle() == told  # settled once and for all
    fsdp_resumed = TrainConfig(mode="fsdp").validate().settle(saved_optimizer="muon")
    assert (fsdp_resumed.optimizer, fsdp_resumed.lr) == ("muon", 4e-3)
    with pytest.raises(UserError, match=r"need 0 <= --min-lr <= --lr .* \(got 0.002, 0.001\)"):
        TrainConfig(min_lr=2e-3).validate().settle(saved_optimizer="adamw")
