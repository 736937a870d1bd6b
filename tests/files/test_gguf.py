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


def _at(data: bytes, offset: int, value: int) -> bytes:
    import struct

    return data[:offset] + struct.pack("<Q", value) + data[offset + 8 :]


@pytest.mark.parametrize("cut", [6, 20, 200, 700, 5000, -100])
def test_a_gguf_file_cut_short_is_one_line_naming_it(chat_model, tmp_path, cut):
    """Cut inside its magic, its counts, its keys, its token list, its tensor infos or its
    tensor data: every reader (the model loader, the tokenizer) says the file is not valid GGUF,
    never struct.error or transformers' own traceback."""
    from llama_ddp.data.tokenizer_files import locate_tokenizer

    data = chat_model["gguf"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    for read in (lambda: read_source(path), lambda: locate_tokenizer(path, tmp_path / "cache")):
        with pytest.raises(UserError) as err:
            read()
        message = str(err.value)
        assert str(path) in message and "\n" not in message
        assert "not a valid GGUF file" in message or "not a GGUF file" in message, message


@pytest.mark.parametrize(
    "where, value, said",
    [
        ("tensors", 2**62, "the tensor count at byte 8 claims 4,611,686,018,427,387,904 items"),
        ("keys", 2**62, "the key/value count at byte 16 claims"),
        ("tokens", 2**40, "tokenizer.ggml.tokens at byte"),
        ("key length", 2**50, "the length of a key at byte 24 claims"),
    ],
)
def test_a_gguf_count_no_file_could_hold_is_refused(chat_model, tmp_path, where, value, said):
    data = chat_model["gguf"].read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    offset = {"tensors": 8, "keys": 16, "tokens": tokens, "key length": 24}[where]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(_at(data, offset, value))
    with pytest.raises(UserError) as err:
        read_source(path)
    assert f"model {path} is not a valid GGUF file: {said}" in str(err.value)
    assert "JSON" not in str(err.value)


def test_a_gguf_tensor_past_the_end_of_its_file_is_refused(chat_model, tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(chat_model["gguf"].read_bytes()[:-100])
    with pytest.raises(UserError, match=r"tensor \S+'s data ends at byte [\d,]+, past the end"):
        read_source(path)
