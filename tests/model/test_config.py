"""model/config.py: LlamaConfig, its presets, checks and JSON form."""

import json
import re

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


def test_weight_bytes_count_every_parameter_and_the_rotary_tables():
    import torch

    from llama_ddp.model.llama import LlamaForPretraining

    for tied in (False, True):
        config = preset("small", vocab_size=1000, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = LlamaForPretraining(config)
        assert config.num_parameters() == model.num_parameters()
        tensors = model.num_parameters() + sum(b.numel() for b in model.buffers())
        assert config.weight_bytes() == 4 * tensors


@pytest.mark.parametrize(
    "overrides",
    [
        {"vocab_size": 10**12},  # the embedding and the lm_head
        {"hidden_size": 10**8},  # every matrix
        {"max_position_embeddings": 10**12},  # the rotary tables, P x head_dim
        {"num_hidden_layers": 10**9},
        {"intermediate_size": 10**11},
    ],
)
def test_a_shape_that_cannot_fit_in_memory_is_refused_before_anything_is_allocated(overrides):
    """From train.py's flags (a preset with overrides), the check the config makes when it is
    made: the host's RAM is the bound, read from the system (no model is built)."""
    from llama_ddp.model.config import memory_bytes

    with pytest.raises(UserError) as err:
        preset("tiny", **{"vocab_size": 97, **overrides})
    assert "for its weights alone; this machine's RAM is" in str(err.value)
    assert f"{memory_bytes() / 2**30:,.1f} GiB" in str(err.value)


def test_a_model_file_that_cannot_fit_names_its_config(tmp_path):
    from llama_ddp.interop.hf import hf_llama_config

    path = tmp_path / "llama_model.json"
    path.write_text(json.dumps({**preset("tiny", vocab_size=97).to_dict(), "vocab_size": 10**12}))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}: a model of this shape"):
        LlamaConfig.load(path)
    hf = {"vocab_size": 1e11, "hidden_size": 64, "intermediate_size": 176,
          "num_hidden_layers": 2, "num_attention_heads": 4, "model_type": "llama"}  # fmt: skip
    with pytest.raises(UserError, match=r"^hf/config.json: a model of this shape .* needs"):
        hf_llama_config(hf, "hf/config.json")


def test_a_gpu_or_a_shard_is_checked_against_its_own_memory(monkeypatch):
    """A GPU's memory is its total (torch.cuda.mem_get_info); an FSDP shard needs its share."""
    import torch

    config = preset("tiny", vocab_size=10**6)  # 0.5 GB of fp32 weights: fits the host
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 2**28))  # 256 MiB
    with pytest.raises(UserError, match="cuda:0's memory is 0.2 GiB"):
        config.check_fits("cuda:0")
    config.check_fits("cuda:0", shards=4)


def test_a_micro_batch_whose_layer_inputs_cannot_fit_is_refused(monkeypatch):
    """One forward keeps every layer's input for the backward: micro-batch x seq x hidden x
    layers values of 2 bytes at the least, against the host's RAM or the GPU's memory."""
    import torch

    config = preset("tiny", vocab_size=97)  # hidden 64, 2 layers: 256 bytes a token at least
    config.check_batch_fits(16, 256, "cpu")
    with pytest.raises(UserError, match=r"micro-batch of 100,000,000 sequences of 256 tokens"):
        config.check_batch_fits(10**8, 256, "cpu")  # 6,104 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 2**30))  # 1 GiB
    config.check_batch_fits(2**14, 256, "cuda:0")  # exactly 1 GiB
    with pytest.raises(UserError, match=r"cuda:0's memory is 1.0 GiB \(lower --batch-size"):
        config.check_batch_fits(2**14 + 1, 256, "cuda:0")


def test_a_member_whose_weights_fit_but_whose_training_state_cannot_is_refused(monkeypatch):
    """Issue 60, item 12: a deep member whose fp32 weights fit the memory (the config's own
    check) but whose weights, gradients and optimizer moments cannot ended in the allocator's
    traceback. Now one line from the batch check, before any data or weight: 3x the weights,
    a shard's share under FSDP."""
    from llama_ddp.model import config as config_module
    from llama_ddp.model.family import member_shape

    monkeypatch.setattr(config_module, "memory_bytes", lambda device="cpu": 50 * 2**30)
    config = LlamaConfig(vocab_size=8192, **member_shape(64))  # 42.3 GiB of weights: fits
    with pytest.raises(UserError) as err:
        config.check_batch_fits(1, 64, "cpu")
    assert str(err.value) == (
        "training a model of this shape (64 layers, hidden_size 4096, vocab_size 8192) needs "
        "126.9 GiB for its weights, their gradients and its optimizer's state alone; this "
        "machine's RAM is 50.0 GiB (choose a smaller --model-size or shape, or shard it on "
        "more devices: --mode fsdp)"
    )
    config.check_batch_fits(1, 64, "cpu", shards=3)  # 42.3 GiB a rank
