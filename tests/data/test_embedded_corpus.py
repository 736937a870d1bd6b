"""embedded_corpus.py: `--dataset sample`: the standard library's sources, 1 in 20 held out."""

import pyarrow.parquet as pq

from llama_ddp.data import embedded_corpus
from llama_ddp.data.embedded_corpus import materialize_sample
from tests.data.test_corpus import load

DOCS = [(f"pkg/m{i:02}.py", f"x = {i}\n") for i in range(41)]


def columns(folder, split):
    table = pq.read_table(folder / f"{split}.parquet")
    return list(zip(table["path"].to_pylist(), table["text"].to_pylist()))


def test_every_twentieth_file_is_held_out_and_the_folder_names_the_content(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded_corpus, "_stdlib_documents", lambda: list(DOCS))
    folder, identity = materialize_sample(tmp_path)
    assert columns(folder, "validation") == [DOCS[0], DOCS[20], DOCS[40]]
    assert columns(folder, "train") == [d for i, d in enumerate(DOCS) if i % 20]
    assert identity["sample"] == 1 and folder.name.startswith("sample-")
    assert materialize_sample(tmp_path) == (folder, identity)
    changed = [*DOCS[:-1], (DOCS[-1][0], "x = 41\n")]  # one file's text changed
    monkeypatch.setattr(embedded_corpus, "_stdlib_documents", lambda: changed)
    other, other_identity = materialize_sample(tmp_path)
    assert other != folder and other_identity["files"] != identity["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, other.name])


def test_a_copy_another_process_renamed_first_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded_corpus, "_stdlib_documents", lambda: list(DOCS))

    def beaten(src, dst):  # a torchrun rank renamed its copy into place first
        dst.mkdir()
        raise OSError("Directory not empty")

    monkeypatch.setattr(embedded_corpus.os, "rename", beaten)
    folder, _ = materialize_sample(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # our temporary removed
    assert not any(folder.iterdir())  # the other's folder, as it is


def test_the_sample_leaves_out_tests_and_tools_and_is_sorted():
    docs = embedded_corpus._stdlib_documents()
    paths = [p for p, _ in docs]
    assert paths == sorted(paths) and "contextlib.py" in paths and "json/decoder.py" in paths
    parts = {part for p in paths for part in p.split("/")[:-1]}
    assert not parts & {"test", "tests", "idlelib", "tkinter", "site-packages", "__pycache__"}
    assert all(p.endswith(".py") for p in paths)


def test_sample_corpus_is_deterministic_and_offline(tmp_path):
    c = load("sample", tmp_path)
    folder = next((tmp_path / "cache").glob("sample-*"))
    mtime = (folder / "train.parquet").stat().st_mtime_ns
    again = load("sample", tmp_path)
    assert again.fingerprint == c.fingerprint
    assert (folder / "train.parquet").stat().st_mtime_ns == mtime  # reused, not rewritten
    train, validation = list(c.train), list(c.validation)
    assert len(validation) * 15 < len(train) < len(validation) * 25  # the fixed 1-in-20 split
    assert not set(train) & set(validation)
    assert 5e6 < sum(map(len, train)) < 15e6
    assert any(t.startswith('"""Utilities for with-statement contexts.') for t in train)
