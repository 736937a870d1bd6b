"""local_files.py: which files a --dataset names, their format, and the validation files of a
folder by their names."""

from pathlib import Path

import pytest

from llama_ddp.data.local_files import (
    data_format,
    data_suffix,
    local_files,
    local_kwargs,
    looks_local,
)
from llama_ddp.errors import UserError


@pytest.mark.parametrize(
    "name, suffix, builder",
    [
        ("a.jsonl", ".jsonl", "json"),
        ("a.JSONL.gz", ".jsonl", "json"),
        ("a.tar.txt.xz", ".txt", "text"),
        ("b.tsv.bz2", ".tsv", "csv"),
        ("c.parquet", ".parquet", "parquet"),
        ("d.gz", "", None),
        ("e.md", ".md", None),
    ],
)
def test_a_files_format_is_read_under_its_compression(name, suffix, builder):
    assert data_suffix(Path(name)) == suffix
    assert data_format(Path(name)) == builder


def test_a_folder_holds_one_format_and_names_its_validation_files(tmp_path):
    for name in ("train.jsonl", "sub/more.jsonl", "val.jsonl", "dev/x.jsonl", ".hidden/y.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    (tmp_path / "notes.md").write_text("not data")
    files = local_files(str(tmp_path))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "dev/x.jsonl", "sub/more.jsonl", "train.jsonl", "val.jsonl",
    ]  # fmt: skip
    kwargs = local_kwargs(files, tmp_path, tmp_path / "cache")
    assert kwargs["path"] == "json"
    assert [Path(f).name for f in kwargs["data_files"]["train"]] == ["more.jsonl", "train.jsonl"]
    assert [Path(f).name for f in kwargs["data_files"]["validation"]] == ["x.jsonl", "val.jsonl"]
    assert looks_local(str(tmp_path)) and looks_local("data/*.jsonl") and not looks_local("org/set")
    (tmp_path / "b.csv").write_text("text\nx\n")
    with pytest.raises(UserError, match="mixes file formats \\(csv, json\\)"):
        local_files(str(tmp_path))
    with pytest.raises(UserError, match="no such file or folder"):
        local_files(str(tmp_path / "missing.jsonl"))
