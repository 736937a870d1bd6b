"""checkpoint/schema.py: every value of a state.json that a resumed run trusts is checked for type
and range, at the edges of each range; a wrong one is a UserError naming the file and the field.
(That every read of a checkpoint applies these checks: test_state.py.)"""

import copy
import random

import numpy as np
import pytest

from llama_ddp.checkpoint.schema import MAX_SECONDS, MAX_STEP, check_state
from llama_ddp.errors import UserError

SOURCE = "checkpoint state out/checkpoints/step-00000003/state.json"
FIX = "(the file is damaged or was edited: resume from another checkpoint)"


def valid() -> dict:
    """A state.json as a run writes it (JSON: tuples become lists), every checked field there."""
    version, words, gauss = random.Random(0).getstate()
    kind, keys, pos, has_gauss, cached = np.random.RandomState(0).get_state()
    return {
        "format": 2,
        "step": 3,
        "parts": {
            "settings": {"model_shape": {"hidden_size": 64}},
            "train": {
                "step": 3,
                "tokens": 100,
                "source_tokens": {"a": 100},
                "seconds": {"train_s": 2.5},
                "budget_spent_s": 12.5,
            },
            "schedule": {
                "name": "wsd",
                "lr": 1e-3,
                "min_lr": 0.0,
                "warmup_steps": 1,
                "total_steps": 9,
                "decay_fraction": 0.2,
            },
            "precision": {"dtype": "bf16"},
            "rng": {
                "python": [version, list(words), gauss],
                "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
                "cuda": {},
            },
            "optimizer": {"param_groups": [{"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8}]},
        },
    }


def with_value(where: tuple, value) -> dict:
    state = valid()
    node = state
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    return state


def test_a_written_state_passes_and_so_does_one_without_its_optional_parts():
    check_state(valid(), SOURCE)
    for part in valid()["parts"]:
        state = valid()
        del state["parts"][part]
        check_state(state, SOURCE)  # an older checkpoint, or a part this run did not have
    check_state({"format": 1, "step": 0}, SOURCE)


@pytest.mark.parametrize(
    "where, value",
    [
        (("format",), 1),
        (("parts", "train", "tokens"), 2**63 - 1),
        (("parts", "schedule", "lr"), 1e-12),  # > 0 is all the lr needs
        (("parts", "schedule", "lr"), 7),  # a whole number is a number
        (("parts", "schedule", "min_lr"), 0),
        (("parts", "schedule", "warmup_steps"), 0),
        (("parts", "schedule", "total_steps"), 1),
        (("parts", "schedule", "decay_fraction"), None),  # cosine, linear, constant
        (("parts", "schedule", "decay_fraction"), 1),
        (("parts", "schedule", "decay_fraction"), 1e-9),
        (("parts", "schedule", "anchor"), None),  # a schedule never re-planned in its decay
        (("parts", "schedule", "anchor"), [40, 1.5e-3]),  # the step and lr it re-planned from
        (("parts", "schedule", "anchor"), [0, 0]),
        (("parts", "train", "budget_spent_s"), 0),
        (("parts", "train", "budget_spent_s"), MAX_SECONDS),
        (("parts", "train", "seconds"), {"train_s": 0.0, "eval_s": float(MAX_SECONDS)}),
        (("parts", "precision", "dtype"), "fp32"),
        (("parts", "precision", "dtype"), "fp16"),
        (("parts", "rng", "python", 2), None),  # no cached gauss
        (("parts", "rng", "python", 2), -0.5),
        (("parts", "rng", "python", 1, 0), 2**32 - 1),
        (("parts", "rng", "numpy", 2), 624),
        (("parts", "rng", "numpy", 3), 1),
        (("parts", "optimizer", "param_groups"), []),
        (("parts", "optimizer", "param_groups", 0, "lr"), 0.0),  # a schedule's lr can reach 0
        (("parts", "optimizer", "param_groups", 0, "foreach"), None),  # only numbers checked
    ],
)
def test_values_at_the_edges_of_their_ranges_pass(where, value):
    check_state(with_value(where, value), SOURCE)


def test_steps_0_and_the_largest_pass_and_one_past_it_does_not():
    for step in (0, MAX_STEP):
        state = with_value(("step",), step)
        state["parts"]["train"]["step"] = step
        check_state(state, SOURCE)
    state = with_value(("step",), MAX_STEP + 1)
    with pytest.raises(UserError) as err:
        check_state(state, SOURCE)
    expected = f"{SOURCE}: step 1000000000001 is not in [0, 1,000,000,000,000] {FIX}"
    assert str(err.value) == expected


@pytest.mark.parametrize(
    "where, value, problem",
    [
        (("format",), 0, "format 0 is not in [1, 2]"),
        (("format",), 3, "format 3 is not in [1, 2]"),
        (("step",), -1, "step -1 is not in [0, 1,000,000,000,000]"),
        (("step",), "3", "step '3' is not a whole number"),
        (("step",), 3.0, "step 3.0 is not a whole number"),
        (("step",), True, "step True is not a whole number"),  # a bool is an int to Python
        (("parts",), [], "parts [] is not a dict"),
        (("parts", "settings"), None, "parts.settings None is not a dict"),
        (("parts", "settings", "model_shape"), "tiny", "parts.settings.model_shape 'tiny' is not"),
        (("parts", "train"), 5, "parts.train 5 is not a dict"),
        (("parts", "train", "tokens"), -1, "parts.train.tokens -1 is not in [0, "),
        (("parts", "train", "tokens"), 2**63, "parts.train.tokens 9223372036854775808 is not"),
        (("parts", "train", "tokens"), 1.5, "parts.train.tokens 1.5 is not a whole number"),
        (("parts", "train", "source_tokens"), [100], "parts.train.source_tokens [100] is not a"),
        (("parts", "train", "seconds"), 1.5, "parts.train.seconds 1.5 is not a dict"),
        # issue 52: a crafted budget_spent_s gave "1000000000055 s left" (-1e12) or "took nan s"
        (
            ("parts", "train", "budget_spent_s"),
            -1e12,
            "parts.train.budget_spent_s -1000000000000.0 is not a finite number in [0, 1e+09]",
        ),
        (
            ("parts", "train", "budget_spent_s"),
            float("nan"),
            "parts.train.budget_spent_s nan is not a finite number in [0, 1e+09]",
        ),
        (
            ("parts", "train", "budget_spent_s"),
            MAX_SECONDS + 1,
            "parts.train.budget_spent_s 1000000001 is not a finite number in [0, 1e+09]",
        ),
        (("parts", "train", "budget_spent_s"), "1h", "parts.train.budget_spent_s '1h' is not a"),
        (
            ("parts", "train", "seconds"),
            {"train_s": -5.0},
            "parts.train.seconds train_s -5.0 is not a finite number in [0, 1e+09]",
        ),
        (
            ("parts", "train", "seconds"),
            {"eval_s": float("inf")},
            "parts.train.seconds eval_s inf is not a finite number in [0, 1e+09]",
        ),
        (
            ("parts", "schedule", "decay_fraction"),
            0,
            "parts.schedule.decay_fraction 0 is not a finite number in (0, 1]",
        ),
        (
            ("parts", "schedule", "decay_fraction"),
            1.5,
            "parts.schedule.decay_fraction 1.5 is not a finite number in (0, 1]",
        ),
        (("parts", "schedule", "name"), 5, "parts.schedule.name 5 is not a str"),
        (("parts", "schedule", "anchor"), [40], "parts.schedule.anchor [40] is not a [step, lr]"),
        (("parts", "schedule", "anchor"), "x", "parts.schedule.anchor 'x' is not a [step, lr]"),
        (("parts", "schedule", "anchor"), [-1, 1e-3], "parts.schedule.anchor -1 is not in [0, "),
        (("parts", "schedule", "anchor"), [4, "fast"], "parts.schedule.anchor 'fast' is not a"),
        (
            ("parts", "schedule", "anchor"),
            [4, float("nan")],
            "parts.schedule.anchor nan is not a finite number >= 0",
        ),
        (("parts", "schedule", "lr"), 0, "parts.schedule.lr 0 is not a finite number > 0"),
        (("parts", "schedule", "lr"), -1e-3, "parts.schedule.lr -0.001 is not a finite number > 0"),
        (("parts", "schedule", "lr"), float("inf"), "parts.schedule.lr inf is not a finite"),
        (("parts", "schedule", "lr"), float("nan"), "parts.schedule.lr nan is not a finite"),
        (("parts", "schedule", "lr"), "fast", "parts.schedule.lr 'fast' is not a number"),
        (("parts", "schedule", "lr"), False, "parts.schedule.lr False is not a number"),
        (
            ("parts", "schedule", "min_lr"),
            -1e-9,
            "parts.schedule.min_lr -1e-09 is not a finite number >= 0",
        ),
        (("parts", "schedule", "warmup_steps"), -1, "parts.schedule.warmup_steps -1 is not in"),
        (("parts", "schedule", "total_steps"), 0, "parts.schedule.total_steps 0 is not in [1, "),
        (
            ("parts", "precision", "dtype"),
            "fp8",
            "parts.precision.dtype 'fp8' is not one of fp32, bf16, fp16",
        ),
        (
            ("parts", "rng", "python"),
            "garbage",
            "parts.rng.python 'garbage' is not Python's random state (version, 625 words, gauss)",
        ),
        (("parts", "rng", "python", 0), 2, "parts.rng.python 2 is not in [3, 3]"),
        (("parts", "rng", "python", 1), [0] * 624, "parts.rng.python is not a list of 625 numbers"),
        (
            ("parts", "rng", "python", 1, 0),
            2**32,
            "parts.rng.python holds a value that is not a 32-bit word",
        ),
        (("parts", "rng", "python", 1, 7), -1, "parts.rng.python holds a value that is not"),
        (("parts", "rng", "python", 1, 7), 1.0, "parts.rng.python holds a value that is not"),
        (("parts", "rng", "python", 2), "x", "parts.rng.python 'x' is not a number"),
        (("parts", "rng", "numpy", 0), "PCG64", "parts.rng.numpy ['PCG64', "),
        (("parts", "rng", "numpy", 1), [0] * 625, "parts.rng.numpy is not a list of 624 numbers"),
        (("parts", "rng", "numpy", 1, 3), 2**32, "parts.rng.numpy holds a value that is not"),
        (("parts", "rng", "numpy", 2), 625, "parts.rng.numpy 625 is not in [0, 624]"),
        (("parts", "rng", "numpy", 3), 2, "parts.rng.numpy 2 is not in [0, 1]"),
        (("parts", "rng", "numpy", 4), float("nan"), "parts.rng.numpy nan is not a finite number"),
        (("parts", "rng", "cuda"), [], "parts.rng.cuda [] is not a dict"),
        (("parts", "optimizer"), "adamw", "parts.optimizer 'adamw' is not a dict"),
        (
            ("parts", "optimizer", "param_groups"),
            {},
            "parts.optimizer.param_groups {} is not a list",
        ),
        (
            ("parts", "optimizer", "param_groups", 0),
            1e-3,
            "parts.optimizer.param_groups [0] is not an object",
        ),
        (
            ("parts", "optimizer", "param_groups", 0, "eps"),
            float("inf"),
            "parts.optimizer.param_groups [0].eps is inf, not a finite number",
        ),
        (
            ("parts", "optimizer", "param_groups", 0, "betas", 1),
            float("-inf"),
            "parts.optimizer.param_groups [0].betas is -inf, not a finite number",
        ),
        (
            ("parts", "optimizer", "param_groups", 0, "lr"),
            -1e-3,
            "parts.optimizer.param_groups [0].lr -0.001 is not a finite number >= 0",
        ),
        (
            ("parts", "optimizer", "param_groups", 0, "lr"),
            "fast",
            "parts.optimizer.param_groups [0].lr 'fast' is not a number",
        ),
    ],
)
def test_a_wrong_type_or_a_value_out_of_range_names_the_file_and_the_field(where, value, problem):
    with pytest.raises(UserError) as err:
        check_state(with_value(where, value), SOURCE)
    message = str(err.value)
    assert message.startswith(f"{SOURCE}: {problem}"), message
    assert message.endswith(FIX) and "\n" not in message


def test_the_trainers_step_is_the_checkpoints():
    state = with_value(("parts", "train", "step"), 4)
    with pytest.raises(UserError) as err:
        check_state(state, SOURCE)
    assert str(err.value) == f"{SOURCE}: parts.train.step 4 is not the checkpoint's step 3 {FIX}"


def test_the_first_wrong_field_is_the_one_named_and_the_state_is_not_changed():
    state = with_value(("parts", "schedule", "lr"), "fast")
    state["step"] = -1  # checked before the schedule
    before = copy.deepcopy(state)
    with pytest.raises(UserError, match=r"state.json: step -1 is not in"):
        check_state(state, SOURCE)
    assert state == before
