"""interop/export.py: any model as one GGUF file, its tokenizer found as every command finds it
(or the one given), the file named after the run. The command: tests/test_export.py."""

import shutil

import pytest
import torch

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


def _export(out, run, **kw):
    from llama_ddp.data.tokenizer_files import read_tokenizer
    from llama_ddp.interop.export import export_run
    from llama_ddp.interop.load import load_model

    model = load_model(out)
    with torch.no_grad():
        model.lm_head.weight.add_(kw.pop("step", 0))
    tokenizer = out / "tokenizer.json"
    export_run(model.state_dict(), model.config, run, tokenizer, read_tokenizer(tokenizer)[1], **kw)


def test_a_set_without_hf_or_gguf_removes_the_earlier_sets_once_it_is_in_place(
    out, tmp_path, monkeypatch, capsys
):
    """Issue 58, item 6: an export that writes neither hf/ nor model.gguf left an earlier
    set's (of another step) beside its llama_model.pth. Now they go once the new set is in
    place, with a line; a new set that fails to be written leaves the earlier one whole."""
    from llama_ddp.errors import WriteFailed
    from llama_ddp.files import safe_io

    run = tmp_path / "run"
    _export(out, run, hf=True, gguf_type="f32")
    earlier = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    assert {"hf", "model.gguf", "llama_model.pth"} <= earlier.keys()

    def refused(*args, **kwargs):
        raise WriteFailed("cannot write model: no space")

    with monkeypatch.context() as m:  # the new set's write fails: the earlier set is untouched
        m.setattr(safe_io, "torch_save", refused)
        with pytest.raises(WriteFailed):
            _export(out, run, hf=False, gguf_type=None, step=1)
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == earlier
    capsys.readouterr()
    _export(out, run, hf=False, gguf_type=None, step=1)
    assert sorted(p.name for p in run.iterdir()) == [
        "llama_model.json", "llama_model.pth", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    said = capsys.readouterr().out
    assert f"removed {run / 'hf'}: an earlier export" in said
    assert f"removed {run / 'model.gguf'}: an earlier export" in said
    head = [torch.load(d / "llama_model.pth", weights_only=True) for d in (run, out)]
    assert torch.equal(head[0]["lm_head.weight"], head[1]["lm_head.weight"] + 1)
    _export(out, run, hf=True, gguf_type=None, step=2)  # hf/ again, and only it
    assert (run / "hf" / "model.safetensors").is_file() and not (run / "model.gguf").exists()
