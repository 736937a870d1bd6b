"""interop/export.py: any model as one GGUF file, its tokenizer found as every command finds it
(or the one given), the file named after the run. The command: tests/test_export.py."""

import shutil

import pytest

from llama_ddp.errors import UserError
from llama_ddp.interop.export import export_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


def metadata(path):
    return {name: f.contents() for name, f in gguf.GGUFReader(path).fields.items()}


def test_a_model_without_its_tokenizer_takes_the_one_tokenizer_names(out, tok, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("llama_model.pth", "llama_model.json"):
        shutil.copy(out / name, bare / name)
    path = tmp_path / "m.gguf"
    with pytest.raises(UserError, match="pass --tokenizer"):
        export_model(bare / "llama_model.pth", path, "f32")
    assert not path.exists()
    export_model(bare / "llama_model.pth", path, "f32", tokenizer=str(out))
    meta = metadata(path)
    assert meta["general.name"] == "bare"
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert meta["tokenizer.ggml.tokens"] == [
        tok.id_to_token(i) for i in range(len(tok.get_vocab()))
    ]
