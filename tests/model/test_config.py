"""model/config.py: LlamaConfig, its presets, checks and JSON form."""

import pytest

from llama_ddp.errors import UserError
from llama_ddp.model.config import LlamaConfig, preset
from tests.model.test_llama import tiny


def test_presets():
    base = preset("base", vocab_size=32000)
    assert (base.hidden_size, base.intermediate_size, base.num_hidden_layers) == (768, 3072, 12)
    assert (base.num_attention_heads, base.num_key_value_heads) == (12, 3)
    assert base.max_position_embeddings == 2048
    t = tiny()
    assert t.num_key_value_heads < t.num_attention_heads
    assert t.max_position_embeddings >= 256
    assert preset("tiny", vocab_size=97, hidden_size=128).hidden_size == 128
    with pytest.raises(UserError, match="unknown preset 'huge'"):
        preset("huge", vocab_size=97)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_size": 66}, "num_attention_heads=4 does not divide hidden_size=66"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be positive"),
        ({"vocab_size": -1}, "vocab_size=-1 must be positive"),
        ({"hidden_size": 12, "num_attention_heads": 4}, "head_dim=3"),
    ],
)
def test_invalid_shapes_name_the_field(overrides, field):
    args = {"vocab_size": 97, **overrides}
    with pytest.raises(UserError, match=field.replace("(", r"\(")):
        LlamaConfig(**{**preset("tiny", vocab_size=97).to_dict(), **args})


def test_config_json_round_trip(tmp_path):
    config = tiny()
    config.save(tmp_path / "c.json")
    assert LlamaConfig.load(tmp_path / "c.json") == config
