"""train/flags.py: how a TrainConfig field is named and offered as a flag, and its checks of each
flag alone (choices, ranges), each refusal naming the flag as the user typed it."""

import dataclasses
import typing
from typing import Literal

import pytest

from llama_ddp.errors import UserError
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.flags import field_default, flag_name, literal_choices

HINTS = typing.get_type_hints(TrainConfig)
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def test_a_field_is_offered_by_its_flag_name_choices_and_default():
    assert flag_name("lr_schedule") == "lr-schedule"
    assert literal_choices(Literal["a", "b"]) == ("a", "b")
    assert literal_choices(Literal["f32", "q8_0"] | None) == ("f32", "q8_0")
    assert literal_choices(int | None) is None
    assert field_default(FIELDS["dataset"]) == "sample"  # a repeatable flag's values, joined
    assert field_default(FIELDS["sources"]) is None
    assert field_default(FIELDS["seq_length"]) == TrainConfig().seq_length


@pytest.mark.parametrize("name", [n for n in FIELDS if literal_choices(HINTS[n])])
def test_every_choice_flag_refuses_a_value_outside_its_choices(name):
    choices = ", ".join(literal_choices(HINTS[name]))
    message = f"--{flag_name(name)} 'nope' is not one of: {choices}"
    with pytest.raises(UserError, match=f"^{message}$"):
        TrainConfig(**{name: "nope"}).validate()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"micro_batch_size": 0}, "--micro-batch-size must be positive, got 0"),
        ({"warmup_steps": -1}, "--warmup-steps must be >= 0, got -1"),
        ({"beta2": 1.0}, r"--beta2 must be in \[0, 1\), got 1.0"),
        ({"grad_clip": float("nan")}, "--grad-clip must be a finite number, got nan"),
        ({"decay_fraction": 0.0}, r"--decay-fraction must be in \(0, 1\], got 0.0"),
    ],
)
def test_a_value_out_of_its_range_is_refused_by_its_flag(change, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        TrainConfig(**change).validate()
