"""files/gguf.py: GGUF files read as transformers reads them, and refused in one line."""

import shutil

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.interop.load import load_model, read_source

transformers = pytest.importorskip("transformers")


def test_a_gguf_file_loads_with_transformers_logits(chat_model):
    """A Q8_0 GGUF written with the gguf package: dequantized, our logits are transformers' for
    the same file; it stays tied, with the source's parameter count."""
    path = chat_model["gguf"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = load_model(path)
    assert ours.config.tie_word_embeddings and ours.config.rope_theta == 5e5
    assert ours.lm_head.weight is ours.base_model.embed_tokens.weight
    source = transformers.AutoModelForCausalLM.from_pretrained(chat_model["source"])
    assert ours.num_parameters() == theirs.num_parameters() == source.num_parameters()
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5
        # Q8_0 is close to the source it was quantized from, not equal
        assert 0 < (ours(ids) - source(ids).logits).abs().max().item() < 0.1


def test_gguf_refusals_are_one_line(chat_model, tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(UserError, match="is named .gguf but is not a GGUF file"):
        read_source(fake)
    copy = tmp_path / "tiny.gguf"
    shutil.copyfile(chat_model["gguf"], copy)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else find_spec(name, *a),
    )
    with pytest.raises(UserError) as err:
        read_source(copy)
    assert str(err.value) == (
        f"model {copy} is a GGUF file; reading it needs the gguf package(s) "
        "(pip install 'llama_ddp[gguf]')"
    )
