"""family.py: the model family's rule (one knob, the depth), its learning rate, and every member a
Llama that transformers loads with the same logits."""

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.interop.hf import export_hf
from llama_ddp.model import family
from llama_ddp.model.config import PRESETS, member, preset
from llama_ddp.model.llama import LlamaForPretraining


def test_the_rule_gives_each_depth_its_width_heads_kv_heads_and_mlp():
    shape = {d: family.member_shape(d) for d in (1, 2, 3, 4, 6, 12, 16)}
    assert [(s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"],
             s["intermediate_size"]) for s in shape.values()] == [
        (64, 1, 1, 192), (128, 2, 1, 384), (192, 3, 1, 512), (256, 4, 1, 704),
        (384, 6, 1, 1024), (768, 12, 3, 2048), (1024, 16, 4, 2752),
    ]  # fmt: skip
    assert all(s["num_hidden_layers"] == d for d, s in shape.items())
    assert {s["max_position_embeddings"] for s in shape.values()} == {2048}
    # small's width and MLP at depth 4 (its 8 heads of 32 aside), base's width at 12
    assert shape[4]["intermediate_size"] == PRESETS["small"]["intermediate_size"]
    assert shape[12]["hidden_size"] == PRESETS["base"]["hidden_size"]


@pytest.mark.parametrize(("heads", "kv"), [(1, 1), (3, 1), (8, 2), (10, 2), (12, 3), (14, 2),
                                           (16, 4), (18, 3), (64, 16)])  # fmt: skip
def test_kv_heads_are_the_largest_divisor_within_a_quarter(heads, kv):
    assert family.kv_heads(heads) == kv


def test_the_family_spans_from_below_tiny_to_beyond_base():
    def count(d: int) -> int:
        return member(d, vocab_size=8192).num_parameters()

    assert count(1) == 1_102_016 < preset("tiny", vocab_size=8192).num_parameters() == 1_141_056
    assert count(4) == preset("small", vocab_size=8192).num_parameters() == 7_014_656
    assert count(16) > preset("base", vocab_size=8192).num_parameters()
    counts = [count(d) for d in range(1, 25)]
    assert counts == sorted(counts)


def test_a_depth_outside_the_family_is_one_line():
    for depth in (0, family.MAX_DEPTH + 1):
        with pytest.raises(UserError, match=rf"--model-size {depth} is not a depth from 1 to 64"):
            family.member_shape(depth)


def test_the_learning_rate_scales_as_one_over_the_width():
    assert [family.lr_scale(64 * d) for d in (1, 2, 4, 16)] == [4.0, 2.0, 1.0, 0.25]
    assert family.lr_scale(768) == pytest.approx(1 / 3)


def test_a_member_is_known_by_its_shape_and_a_preset_is_not():
    assert [family.depth_of(member(d, vocab_size=300).to_dict()) for d in (1, 5, 12)] == [1, 5, 12]
    assert family.depth_of(member(3, vocab_size=300, tie_word_embeddings=True).to_dict()) == 3
    assert family.depth_of(member(3, vocab_size=300, num_key_value_heads=3).to_dict()) is None
    assert {family.depth_of(preset(p, vocab_size=300).to_dict()) for p in PRESETS} == {None}


def test_shape_flags_override_a_member_as_a_preset():
    config = member(2, vocab_size=300, max_position_embeddings=512, rope_theta=5e5)
    assert (config.hidden_size, config.max_position_embeddings, config.rope_theta) == (
        128, 512, 5e5,
    )  # fmt: skip


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8])
def test_every_member_exports_to_transformers_with_the_same_logits(depth, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(depth)
    model = LlamaForPretraining(member(depth, vocab_size=211, max_position_embeddings=64)).eval()
    with torch.no_grad():  # random norms too, so parity covers their weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    export_hf(model, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.num_key_value_heads == family.member_shape(depth)["num_key_value_heads"]
    ids = torch.randint(0, 211, (2, 48))
    with torch.no_grad():
        ours, ref = model(ids), theirs(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5 * max(1.0, ours.abs().max().item())
