"""settings.py: how a component's setting is named and offered as a flag, and every component's
checks of its own values (choices, ranges), each refusal naming the flag as the user typed it."""

from typing import Literal

import pytest

from llama_ddp.checkpoint.manager import CheckpointSettings
from llama_ddp.data.sources import DataSettings
from llama_ddp.errors import UserError
from llama_ddp.model.config import ModelSettings
from llama_ddp.settings import field_default, flag_name, literal_choices
from llama_ddp.train.config import FLAGS, OutputSettings, RuntimeSettings, TrainConfig
from llama_ddp.train.optim import OptimizerSettings, ScheduleSettings
from llama_ddp.train.validation import EvalSettings

COMPONENTS = {
    "model": ModelSettings,
    "data": DataSettings,
    "optim": OptimizerSettings,
    "schedule": ScheduleSettings,
    "runtime": RuntimeSettings,
    "checkpoint": CheckpointSettings,
    "eval": EvalSettings,
    "output": OutputSettings,
}


def test_a_field_is_offered_by_its_flag_name_choices_and_default():
    assert flag_name("lr_schedule") == "lr-schedule"
    assert literal_choices(Literal["a", "b"]) == ("a", "b")
    assert literal_choices(Literal["f32", "q8_0"] | None) == ("f32", "q8_0")
    assert literal_choices(int | None) is None
    assert field_default(FLAGS["dataset"].field) == "sample"  # a repeatable flag's values, joined
    assert field_default(FLAGS["sources"].field) is None
    assert field_default(FLAGS["seq_length"].field) == DataSettings().seq_length == 256


def test_the_training_config_composes_the_components():
    assert {name: type(part) for name, part in vars(TrainConfig()).items()} == COMPONENTS


CHOICES = [name for name, flag in FLAGS.items() if literal_choices(flag.hint)]


@pytest.mark.parametrize("name", CHOICES)
def test_every_choice_flag_refuses_a_value_outside_its_choices(name):
    """Refused by the component's own validate, and so by the training config's."""
    component = COMPONENTS[FLAGS[name].component]
    choices = ", ".join(literal_choices(FLAGS[name].hint))
    message = f"--{flag_name(name)} 'nope' is not one of: {choices}"
    with pytest.raises(UserError, match=f"^{message}$"):
        component(**{name: "nope"}).validate()
    with pytest.raises(UserError, match=f"^{message}$"):
        TrainConfig.from_flags(**{name: "nope"}).validate()


def test_the_choice_flags_are_those_of_every_registry():
    assert CHOICES == [
        "preset",
        "packing",
        "optimizer",
        "lr_schedule",
        "mode",
        "device",
        "dtype",
        "attention",
    ] + ["export_gguf"]


@pytest.mark.parametrize(
    "component, change, message",
    [
        (
            ModelSettings,
            {"rope_theta": float("inf")},
            "--rope-theta must be a finite number, got inf",
        ),
        (DataSettings, {"seq_length": 0}, "--seq-length must be positive, got 0"),
        (DataSettings, {"micro_batch_size": 0}, "--micro-batch-size must be positive, got 0"),
        (
            DataSettings,
            {"micro_batch_size": "lots"},
            "--micro-batch-size must be a positive integer or auto, got 'lots'",
        ),
        (DataSettings, {"num_workers": -1}, "--num-workers must be >= 0, got -1"),
        (DataSettings, {"val_fraction": 1.0}, r"--val-fraction must be in \(0, 1\), got 1.0"),
        (
            DataSettings,
            {"dataset": ("a", "b"), "dataset_weights": "1"},
            r"--dataset-weights gives 1 weight\(s\) for 2 --dataset source\(s\).*",
        ),
        (OptimizerSettings, {"beta2": 1.0}, r"--beta2 must be in \[0, 1\), got 1.0"),
        (
            OptimizerSettings,
            {"grad_clip": float("nan")},
            "--grad-clip must be a finite number, got nan",
        ),
        (OptimizerSettings, {"weight_decay": -0.1}, "--weight-decay must be >= 0, got -0.1"),
        (ScheduleSettings, {"warmup_steps": -1}, "--warmup-steps must be >= 0, got -1"),
        (
            ScheduleSettings,
            {"decay_fraction": 0.0},
            r"--decay-fraction must be in \(0, 1\], got 0.0",
        ),
        (ScheduleSettings, {"max_steps": 0}, "--max-steps must be positive, got 0"),
        (RuntimeSettings, {"peak_tflops": 0.0}, "--peak-tflops must be positive, got 0.0"),
        (RuntimeSettings, {"profile_steps": "5:1"}, "--profile-steps.*"),
        (
            RuntimeSettings,
            {"mode": "dp", "compile": True},
            "--compile does not work with --mode dp.*",
        ),
        (CheckpointSettings, {"keep_last": 0}, "--keep-last must be positive, got 0"),
        (CheckpointSettings, {"save_every": -2}, "--save-every must be >= 0, got -2"),
        (
            EvalSettings,
            {"eval_tokens": "lots"},
            "--eval-tokens must be a positive number or `all`.*",
        ),
        (EvalSettings, {"eval_limit": 0}, "--eval-limit must be positive, got 0"),
        (EvalSettings, {"eval_every": -1}, "--eval-every must be >= 0, got -1"),
        (OutputSettings, {"log_every": 0}, "--log-every must be positive, got 0"),
        (OutputSettings, {"log_to": "csv"}, "--log-to 'csv' is not one of: tensorboard, wandb"),
    ],
)
def test_each_component_refuses_its_bad_values_by_their_flags(component, change, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        component(**change).validate()
    with pytest.raises(UserError, match=f"^{message}$"):
        TrainConfig.from_flags(**change).validate()


def test_a_components_defaults_pass_its_checks():
    for component in COMPONENTS.values():
        assert component().validate() == component()
