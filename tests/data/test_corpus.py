"""corpus.py: text from files, folders, globs and hub datasets, held out, keyed."""

import json
import os
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llama_ddp.data import corpus as corpus_mod
from llama_ddp.data.corpus import default_cache_dir, load_splits
from llama_ddp.errors import UserError


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def load(dataset, tmp_path, **kwargs):
    return load_splits(str(dataset), cache_dir=tmp_path / "cache", **kwargs)


DOCS = [f"document number {i}" for i in range(10)]


def test_jsonl_holds_out_every_kth_document(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    c = load(data, tmp_path, val_fraction=0.25)  # k = round(1 / 0.25) = 4
    assert list(c.validation) == [DOCS[0], DOCS[4], DOCS[8]]
    assert list(c.train) == [d for i, d in enumerate(DOCS) if i % 4]


def test_holdout_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_HOLDOUT_DOCS", 2)
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    c = load(data, tmp_path, val_fraction=0.5)
    assert list(c.validation) == [DOCS[0], DOCS[2]]
    assert list(c.train) == [DOCS[1], *DOCS[3:]]


def test_streaming_gives_the_same_splits(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    eager = load(data, tmp_path, val_fraction=0.3)
    lazy = load(data, tmp_path, val_fraction=0.3, streaming=True)
    assert list(lazy.train) == list(eager.train)
    assert list(lazy.validation) == list(eager.validation)
    assert lazy.fingerprint == eager.fingerprint


def test_txt_folder_is_one_document_per_file_with_named_validation(tmp_path):
    folder = tmp_path / "books"
    (folder / "test").mkdir(parents=True)
    (folder / "a.txt").write_text("first book\n\nwith two paragraphs\n")
    (folder / "b.txt").write_text("second book\n")
    (folder / "validation-01.txt").write_text("held out\n")
    (folder / "test" / "c.txt").write_text("also held out\n")
    (folder / "notes.md").write_text("ignored: not a data format")
    c = load(folder, tmp_path)
    assert list(c.train) == ["first book\n\nwith two paragraphs\n", "second book\n"]
    assert sorted(c.validation) == ["also held out\n", "held out\n"]


def test_single_txt_file_is_cut_into_paragraphs(tmp_path):
    # Tiny Shakespeare's input.txt: speeches separated by blank lines.
    speeches = [f"SPEAKER {i}:\nline {i}a\nline {i}b" for i in range(8)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "input.txt").write_text("\n\n".join(speeches) + "\n")
    c = load(tmp_path / "data" / "input.txt", tmp_path, val_fraction=0.25)
    assert [t.strip() for t in c.validation] == [speeches[0], speeches[4]]
    assert [t.strip() for t in c.train] == [s for i, s in enumerate(speeches) if i % 4]
    folder = load(tmp_path / "data", tmp_path, val_fraction=0.25)  # a folder of one file: the same
    assert list(folder.train) == list(c.train)


def test_single_txt_file_without_blank_lines_is_cut_into_lines(tmp_path):
    (tmp_path / "book.txt").write_text("".join(f"line {i}\n" for i in range(6)))
    c = load(tmp_path / "book.txt", tmp_path, val_fraction=0.5)
    assert [t.strip() for t in c.validation] == ["line 0", "line 2", "line 4"]
    assert [t.strip() for t in c.train] == ["line 1", "line 3", "line 5"]


def test_single_line_txt_file_is_too_small(tmp_path):
    (tmp_path / "book.txt").write_text("only one line\n")
    with pytest.raises(UserError, match="has one document, too few to hold out"):
        load(tmp_path / "book.txt", tmp_path)


def test_parquet_file_and_glob(tmp_path):
    for part in range(2):
        rows = DOCS[part * 5 : part * 5 + 5]
        pq.write_table(pa.table({"content": rows}), tmp_path / f"part-{part}.parquet")
    c = load(tmp_path / "part-0.parquet", tmp_path, text_column="content", val_fraction=0.5)
    assert list(c.train) + list(c.validation) == [DOCS[1], DOCS[3], DOCS[0], DOCS[2], DOCS[4]]
    c = load(tmp_path / "part-*.parquet", tmp_path, text_column="content", val_fraction=0.1)
    assert list(c.validation) == [DOCS[0]]
    assert list(c.train) == DOCS[1:]


def test_csv_tsv_and_compressed_files(tmp_path):
    import csv
    import gzip

    docs = [*DOCS[:9], 'a "quoted", comma\tand tab\nover two lines']
    for name, sep in (("d.csv", ","), ("d.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f, delimiter=sep)
            writer.writerows([["n", "body"], *enumerate(docs)])
        c = load(tmp_path / name, tmp_path, text_column="body", val_fraction=0.5)
        assert list(c.validation) + list(c.train) == docs[::2] + docs[1::2], name
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    (tmp_path / "z").mkdir()
    with gzip.open(tmp_path / "z" / "d.jsonl.gz", "wt") as f:
        f.write(data.read_text())
    assert list(load(tmp_path / "z" / "d.jsonl.gz", tmp_path).train) == list(
        load(data, tmp_path).train
    )
    with gzip.open(tmp_path / "z" / "book.txt.gz", "wt") as f:
        f.write("\n\n".join(DOCS))  # one .txt, compressed: cut into paragraphs as well
    c = load(tmp_path / "z" / "book.txt.gz", tmp_path, val_fraction=0.5)
    assert list(c.validation) + list(c.train) == DOCS[::2] + DOCS[1::2]


def test_json_array_and_split_slicing(tmp_path):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"text": t} for t in DOCS]))
    c = load(data, tmp_path, split="train[:4]", val_fraction=0.5)
    assert list(c.train) == [DOCS[1], DOCS[3]]


def test_fingerprint_is_stable_and_tracks_the_data(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load(data, tmp_path).fingerprint
    assert load(data, tmp_path).fingerprint == first
    assert load(data, tmp_path, val_fraction=0.5).fingerprint != first
    time.sleep(0.01)
    write_jsonl(data, DOCS[:-1])
    assert load(data, tmp_path).fingerprint != first


def test_wrong_text_column_lists_the_columns(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS, column="body")
    with pytest.raises(UserError, match="no text column 'text'; its columns are body, id"):
        load(data, tmp_path)
    with pytest.raises(UserError, match="its columns are body, id"):
        load(data, tmp_path, streaming=True)


def test_non_text_column_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(UserError, match="column 'id' .* not text"):
        load(data, tmp_path, text_column="id")


def test_missing_paths_and_unusable_folders(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        load(tmp_path / "missing.jsonl", tmp_path)
    with pytest.raises(UserError, match="no .* files match"):
        load(tmp_path / "*.parquet", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no"):
        load(tmp_path / "empty", tmp_path)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    write_jsonl(tmp_path / "mixed" / "b.jsonl", DOCS)
    with pytest.raises(UserError, match="mixes file formats"):
        load(tmp_path / "mixed", tmp_path)
    (tmp_path / "data.xlsx").write_text("text\nx\n")
    with pytest.raises(UserError, match="is not a .* file"):
        load(tmp_path / "data.xlsx", tmp_path)
    (tmp_path / "seps").mkdir()
    (tmp_path / "seps" / "a.csv").write_text("text\nx\n")
    (tmp_path / "seps" / "b.tsv").write_text("text\ny\n")
    with pytest.raises(UserError, match="mixes .csv and .tsv"):
        load(tmp_path / "seps", tmp_path)


def test_empty_documents_are_skipped_and_an_empty_corpus_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ["", "kept", "", "also kept"])
    c = load(data, tmp_path, val_fraction=0.5)
    assert list(c.train) == ["kept", "also kept"]
    with pytest.raises(UserError, match="hold-out .* has no non-empty documents"):
        list(c.validation)
    with pytest.raises(UserError, match="no documents"):
        load(write_jsonl(tmp_path / "e.jsonl", []), tmp_path)


def test_unknown_hub_dataset_fails_fast_offline(tmp_path):
    start = time.perf_counter()
    with pytest.raises(UserError, match="neither a local file or folder nor a reachable hub"):
        load("nobody/no-such-dataset", tmp_path)
    assert time.perf_counter() - start < 5


def test_hub_path_uses_the_sources_test_split(tmp_path, monkeypatch):
    # `datasets` resolves a folder like a hub repository: the hub code path, without a network.
    write_jsonl(tmp_path / "repo" / "train.jsonl", DOCS[:6])
    write_jsonl(tmp_path / "repo" / "test.jsonl", DOCS[6:])
    monkeypatch.setattr(corpus_mod, "looks_local", lambda dataset: False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")  # not ~/.cache
    c = load(tmp_path / "repo", tmp_path)
    assert list(c.train) == DOCS[:6]
    assert list(c.validation) == DOCS[6:]
    with pytest.raises(UserError, match="cannot load split 'dev'"):
        load(tmp_path / "repo", tmp_path, split="dev")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_DDP_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LLAMA_DDP_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "llama_ddp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "llama_ddp"


def test_save_to_disk_folders_load_with_their_splits(tmp_path):
    texts = [f"saved document {i}" for i in range(30)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "one"))
    c = load(tmp_path / "one", tmp_path, val_fraction=0.1)  # one Dataset: the train split
    assert list(c.validation) == texts[:30:10] and len(list(c.train)) == 27
    both = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:20]}),
            "validation": datasets.Dataset.from_dict({"text": texts[20:]}),
        }
    )
    both.save_to_disk(str(tmp_path / "dict"))
    c = load(tmp_path / "dict", tmp_path)
    assert list(c.train) == texts[:20] and list(c.validation) == texts[20:]
    with pytest.raises(UserError, match="has no split 'test'; its splits are train, validation"):
        load(tmp_path / "dict", tmp_path, split="test")


@pytest.mark.parametrize("name", ["[draft] v1.jsonl", "a*b?.jsonl", "sub[1]/x.jsonl"])
def test_a_path_that_exists_is_that_file_whatever_its_name(tmp_path, name):
    """[ ] * ? in a name that exists are characters, not a pattern: for which files it names,
    and for datasets, which reads data_files as patterns; read alone and inside a folder."""
    data = write_jsonl(tmp_path / "d" / name, DOCS)
    assert list(load(data, tmp_path, val_fraction=0.5).train) == DOCS[1::2]
    assert list(load(data.parent, tmp_path, val_fraction=0.5).train) == DOCS[1::2]


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_dataset_that_is_not_a_regular_file_is_named_as_such(tmp_path, kind):
    import os
    import socket

    path = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
        server = None
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    try:
        with pytest.raises(UserError, match=r"--dataset .*data.jsonl is not a regular file but a"):
            load(path, tmp_path)
    finally:
        if server is not None:
            server.close()


@pytest.mark.parametrize("where", ["cache", "cache/sub"])
def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, where):
    """--cache-dir, or $LLAMA_DDP_CACHE, naming a file (or a folder under one): every reader of
    the cache (the sample corpus, a local dataset's datasets cache) says so."""
    (tmp_path / "cache").write_text("not a folder")
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    for dataset in ("sample", str(data)):
        with pytest.raises(UserError, match=r"cache folder .* is a file, not a folder"):
            load_splits(dataset, cache_dir=tmp_path / where)
    monkeypatch.setenv("LLAMA_DDP_CACHE", str(tmp_path / where))
    with pytest.raises(UserError, match=r"\(--cache-dir or \$LLAMA_DDP_CACHE\): .*cache is a file"):
        load_splits(str(data))


def test_a_checked_corpus_is_noted_and_read_again_only_when_used(tmp_path):
    """Once a run checked a corpus (pipeline.open_corpora), the same files open from its note:
    the same fingerprint and size without reading them, the same texts once read. Other
    settings, a changed file or a damaged note: read again."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load(data, tmp_path, val_fraction=0.25)
    assert first.splits is not None and not first.checked  # read now: nothing noted yet
    first.check()
    (note,) = (tmp_path / "cache").glob("corpus-*.txt")
    again = load(data, tmp_path, val_fraction=0.25)
    assert (again.fingerprint, again.size, again.checked) == (first.fingerprint, first.size, True)
    assert again.splits is None  # nothing read
    assert list(again.train) == list(first.train) == [d for i, d in enumerate(DOCS) if i % 4]
    assert list(again.validation) == list(first.validation) == DOCS[::4]
    other = load(data, tmp_path, val_fraction=0.5)  # another hold-out: another fingerprint
    assert other.splits is not None and other.fingerprint != first.fingerprint
    note.write_text(first.fingerprint[:-1])  # damaged
    damaged = load(data, tmp_path, val_fraction=0.25)
    assert damaged.splits is not None and damaged.fingerprint == first.fingerprint
    write_jsonl(data, [*DOCS, "one more document"])
    changed = load(data, tmp_path, val_fraction=0.25)
    assert changed.splits is not None and changed.fingerprint != first.fingerprint


def test_a_note_damaged_into_another_fingerprint_is_read_as_damaged(tmp_path):
    """A note whose fingerprint changed by one hexadecimal digit, or another note's text under
    this note's name, still looks like a fingerprint: it was taken as this corpus's, and a
    resume was refused as "trained with a different corpus" with no word of the note. A note
    carries a checksum of its name and fingerprint: such a note is damaged, its files are read
    again and give the corpus's own fingerprint."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load(data, tmp_path, val_fraction=0.25)
    first.check()
    (note,) = (tmp_path / "cache").glob("corpus-*.txt")
    text = note.read_text()
    flipped = ("1" if text[0] == "0" else "0") + text[1:]
    other = load(data, tmp_path, val_fraction=0.5)
    other.check()
    (elsewhere,) = set((tmp_path / "cache").glob("corpus-*.txt")) - {note}
    for damaged in (flipped, first.fingerprint, elsewhere.read_text()):
        note.write_text(damaged)
        again = load(data, tmp_path, val_fraction=0.25)
        assert again.splits is not None and again.fingerprint == first.fingerprint
    note.write_text(text)
    assert load(data, tmp_path, val_fraction=0.25).splits is None  # intact: read from the note


def test_a_file_changed_in_place_with_its_size_and_time_kept_is_taken_as_unchanged(tmp_path):
    """What docs/data.md says of the token cache: a local file is known by its path, size and
    modification time, not by its content. Changed in place with both kept, it keeps its
    fingerprint (a run trains on the tokens of its old content); touched, it gets a new one."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = load(data, tmp_path, val_fraction=0.25)
    kept = data.stat()
    data.write_text(data.read_text().replace("number", "NUMBER"))
    os.utime(data, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    changed = load(data, tmp_path, val_fraction=0.25)
    assert changed.fingerprint == first.fingerprint
    assert next(iter(changed.train)) == "document NUMBER 1"  # the new content, read now
    os.utime(data)  # touch
    assert load(data, tmp_path, val_fraction=0.25).fingerprint != first.fingerprint
