"""export.py: `python -m llama_ddp.export MODEL --gguf OUT.gguf` over interop/export.py: the line
it prints, its refusals as one line and exit code 2. What export_model finds and writes:
tests/interop/test_export.py; the file's contents: tests/interop/test_gguf_export.py."""

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


def test_a_model_without_its_tokenizer_is_one_line_and_exit_2(out, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("llama_model.pth", "llama_model.json"):
        shutil.copy(out / name, bare / name)
    path = tmp_path / "m.gguf"
    assert export_main([str(bare / "llama_model.pth"), "--gguf", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--tokenizer" in err and err.count("\n") == 1
    assert not path.exists()


@pytest.mark.parametrize("place", ["/proc/x.gguf", "/sys/x.gguf"])
def test_a_place_that_cannot_hold_files_is_named_so(out, place, capsys):
    """/proc has no disk behind it: not "the disk has 0.0 MB free" (free space will not help)."""
    assert export_main([str(out), "--gguf", place]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot write GGUF file {place}: the place cannot hold files, it is a virtual "
        "filesystem with no disk behind it, like /proc (choose another location)\n"
    )
