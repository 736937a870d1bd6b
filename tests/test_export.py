"""export.py: `python -m llama_ddp.export MODEL --gguf OUT.gguf` over interop/export.py, the
model and its tokenizer found as every command finds them, the file named after the run. Its
refusals and the file's contents are tests/interop/test_gguf_export.py's."""

import shutil

import pytest

from llama_ddp.export import main as export_main

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


def metadata(path):
    return {name: f.contents() for name, f in gguf.GGUFReader(path).fields.items()}


def test_a_run_folder_is_one_file_named_after_the_run(out, tok, tmp_path, capsys):
    path = tmp_path / "m.gguf"
    assert export_main([str(out), "--gguf", str(path), "--type", "f16"]) == 0
    size = path.stat().st_size / 2**20
    assert capsys.readouterr().out == f"wrote {path} (f16, {size:,.1f} MiB): llama-cli -m {path}\n"
    meta = metadata(path)
    assert meta["general.name"] == out.name
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert len(meta["tokenizer.ggml.tokens"]) == tok.get_vocab_size()


def test_a_model_without_its_tokenizer_takes_the_one_tokenizer_names(out, tok, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("llama_model.pth", "llama_model.json"):
        shutil.copy(out / name, bare / name)
    path = tmp_path / "m.gguf"
    assert export_main([str(bare / "llama_model.pth"), "--gguf", str(path)]) == 2
    args = [str(bare / "llama_model.pth"), "--gguf", str(path), "--tokenizer", str(out)]
    assert export_main(args) == 0
    meta = metadata(path)
    assert meta["general.name"] == "bare"
    assert meta["tokenizer.ggml.tokens"] == [
        tok.id_to_token(i) for i in range(len(tok.get_vocab()))
    ]
