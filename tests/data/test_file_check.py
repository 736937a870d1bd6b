"""file_check.py: a broken data file of any format is one line naming the file, the line (or
row group) in it and what is wrong there, found at the start or later by the cache's builder."""

import bz2
import csv
import gzip
import io
import itertools
import json
import lzma
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llama_ddp.checkpoint.state import verify_checkpoint
from llama_ddp.data.cache.build import Job, Sharding
from llama_ddp.data.cache.builder import Builder
from llama_ddp.data.corpus import load_splits
from llama_ddp.data.file_check import DataFiles, find_break
from llama_ddp.data.pipeline import TrainData
from llama_ddp.data.tokenizer_files import special_ids
from llama_ddp.errors import UserError
from tests.helpers.runs import tiny_args, train_here


def lines(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(start, n))


def csv_text(rows: list[list[str]], sep: str = ",") -> str:
    out = io.StringIO()
    csv.writer(out, delimiter=sep, lineterminator="\n").writerows(rows)
    return out.getvalue()


def parquet_bytes(row_groups: int = 3, damage: int | None = None) -> bytes:
    """A Parquet file of ``row_groups`` groups of 100 rows, uncompressed; ``damage``: the group
    whose first page header is overwritten."""
    table = pa.table({"text": [f"document {i} " * 4 for i in range(100 * row_groups)]})
    out = pa.BufferOutputStream()
    pq.write_table(table, out, row_group_size=100, compression="none")
    data = bytearray(out.getvalue().to_pybytes())
    if damage is not None:
        meta = pq.ParquetFile(pa.BufferReader(bytes(data))).metadata
        offset = meta.row_group(damage).column(0).data_page_offset
        data[offset : offset + 16] = b"\xff" * 16
    return bytes(data)


CUT = json.dumps([{"text": "a"}, {"text": "b"}], indent=1)[:-8]
# name -> (file name, its bytes, what the one line says after "cannot read <path>: ")
BROKEN = {
    "jsonl: first line not JSON": (
        "d.jsonl",
        ("not json\n" + lines(20)).encode(),
        "line 1, column 1: not valid JSON: expected a JSON value (fix or remove that line)",
    ),
    "jsonl: a string never closed, line 351 (pyarrow says row 350 of its block)": (
        "d.jsonl",
        (lines(350) + '{"text": "never closed\n' + lines(400, 351)).encode(),
        "line 351, column 10: not valid JSON: a string opens here and is never closed",
    ),
    "jsonl: a line that is no object": (
        "d.jsonl",
        (lines(5) + "[1, 2]\n" + lines(10, 6)).encode(),
        'line 6: holds a list, not an object such as {"text": "..."}',
    ),
    "jsonl: bytes that are not UTF-8": (
        "d.jsonl",
        lines(20).encode() + b'{"text": "caf\xe9"}\n',
        f"byte {len(lines(20)) + 13:,} (line 21, column 14): 0xe9 is not UTF-8 (invalid "
        "continuation byte)",
    ),
    "json: a document cut short": (
        "d.json",
        CUT.encode(),
        f"line {CUT.count(chr(10)) + 1}, column {len(CUT.splitlines()[-1]) + 1}: not valid JSON: "
        "the file ends inside the document (cut short?) (fix the file there)",
    ),
    "txt: bytes that are not UTF-8 at byte 1,100": (
        "d.txt",
        b"paragraph\n\n" * 100 + b"\xff\xfe end\n",
        "byte 1,100 (line 201, column 1): 0xff is not UTF-8 (invalid start byte) (save the file "
        "as UTF-8, or drop the bytes that are not: `iconv -f utf-8 -t utf-8 -c d.txt > fixed.txt`)",
    ),
    "jsonl.gz: truncated": (
        "d.jsonl.gz",
        gzip.compress(lines(2000).encode(), mtime=0)[:-200],
        "the file is truncated: its compressed data ends early, after line ",
    ),
    "txt.bz2: truncated": (
        "d.txt.bz2",
        bz2.compress(b"one paragraph\n\nand another\n" * 50)[:-20],
        "the file is truncated: its compressed data ends early, in its first lines",
    ),
    "jsonl.xz: not xz data": (
        "d.jsonl.xz",
        lines(20).encode(),
        "not xz data, though named .xz (rename or compress it)",
    ),
    "txt.gz: bytes that are not UTF-8": (
        "d.txt.gz",
        gzip.compress(b"hello\n\nworld\n" * 10 + b"x\xc3(\n"),
        "byte 131 of its decompressed text (line 31, column 2): 0xc3 is not UTF-8",
    ),
    "csv: a quote never closed": (
        "d.csv",
        csv_text([["text"], ["a"]]).encode() + b'"b\nc\n' + b"d\n" * 10,
        'line 3: a quoted field opens in this row and is never closed (an unmatched ")',
    ),
    "csv: more fields than the header": (
        "d.csv",
        csv_text([["n", "text"], *([str(i), "doc"] for i in range(10)), ["1", "x", "y"]]).encode(),
        "line 12: 3 fields where the header has 2 (quote the fields that hold ',', or remove",
    ),
    "csv: bytes that are not UTF-8": (
        "d.csv",
        b"text\n" + b"abc\n" * 10 + b"x\xffy\n",
        "byte 46 (line 12, column 2): 0xff is not UTF-8",
    ),
    "tsv: a quote never closed": (
        "d.tsv",
        csv_text([["n", "text"], *([str(i), "doc"] for i in range(10))], "\t").encode()
        + b'11\t"open\n12\tdoc\n',
        "line 12: a quoted field opens in this row and is never closed",
    ),
    "parquet: truncated": (
        "d.parquet",
        parquet_bytes()[:-100],
        "not a Parquet file, or its end is missing (",
    ),
    "parquet: a damaged row group": (
        "d.parquet",
        parquet_bytes(damage=1),
        "row group 2 of 3 (rows 101-200): damaged (",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_file_is_one_line_naming_it_and_the_place(case, tmp_path):
    name, content, expected = BROKEN[case]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError) as error:  # read through `datasets`, as a run reads it
        corpus = load_splits(str(path), cache_dir=tmp_path / "cache", val_fraction=0.5)
        for split in (corpus.train, corpus.validation):
            sum(1 for _ in split)
    message = str(error.value)
    assert message.startswith(f"cannot read {path}: {expected}"), message
    assert "\n" not in message


GOOD = {
    "d.jsonl": (lines(3) + "\n  \n" + lines(6, 3)).encode(),
    "bom.jsonl": b"\xef\xbb\xbf" + lines(5).encode(),
    "d.json": json.dumps([{"text": "a"}, {"text": "b"}], indent=2).encode(),
    "lines.json": lines(5).encode(),
    "d.txt": "héllo\n\nwörld 🦙\n".encode(),
    "d.jsonl.gz": gzip.compress(lines(50).encode()),
    "d.txt.bz2": bz2.compress(b"a\n\nb\n"),
    "d.csv.xz": lzma.compress(csv_text([["text"], ['a "quoted",\nline'], ["b"]]).encode()),
    "d.tsv": csv_text([["n", "text"], ["1", "a\tb"], [], ["2", "c"]], "\t").encode(),
    "d.parquet": parquet_bytes(),
}
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".tsv": "csv"}


@pytest.mark.parametrize("name", list(GOOD))
def test_a_good_file_has_no_break(name, tmp_path):
    path = tmp_path / name
    path.write_bytes(GOOD[name])
    data = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz")][-1]
    builder = BUILDERS.get(data, "parquet")
    assert find_break(path, builder, "\t" if data == ".tsv" else ",") is None
    corpus = load_splits(str(path), cache_dir=tmp_path / "cache", val_fraction=0.5)
    assert sum(1 for _ in corpus.train) >= 1  # `datasets` reads it too


def test_a_failure_no_break_explains_is_raised_as_it_was(tmp_path):
    (tmp_path / "d.jsonl").write_text(lines(3))
    files = DataFiles((str(tmp_path / "d.jsonl"),), "json")
    with pytest.raises(KeyError, match="not about the file"), files.reading():
        raise KeyError("not about the file")


def test_a_break_past_the_first_block_keeps_its_own_line_number(tmp_path):
    """pandas reads a CSV 10,000 rows at a time: the break at line 12,003 opens fine and is met
    later, still named by its line in the file."""
    path = tmp_path / "d.csv"
    path.write_text("text\n" + "".join(f"row {i}\n" for i in range(12001)) + '"open\nx\ny\n')
    corpus = load_splits(str(path), cache_dir=tmp_path / "cache", val_fraction=0.5)
    texts = iter(corpus.train)
    assert next(texts) == "row 1"
    with pytest.raises(UserError, match=f"^cannot read {path}: line 12003: a quoted field"):
        sum(1 for _ in texts)


def folder_breaking_late(root: Path, docs: int) -> Path:
    """a.jsonl: ``docs`` good documents; b.jsonl: its line 7 never closes a string; and a
    validation file of its own (no hold-out scans the train files ahead)."""
    root.mkdir()
    (root / "a.jsonl").write_text(
        "".join(
            json.dumps({"text": f"the cat {i} runs over the red house"}) + "\n" for i in range(docs)
        )
    )
    (root / "b.jsonl").write_text(lines(6) + '{"text": "never closed\n' + lines(20, 7))
    (root / "validation.jsonl").write_text(lines(4))
    return root


def test_a_break_the_builder_meets_is_raised_by_check(tmp_path, tiny_tokenizer):
    data = folder_breaking_late(tmp_path / "data", 1500)
    corpus = load_splits(str(data), cache_dir=tmp_path / "cache")  # opens and starts fine
    job = Job(tmp_path / "tokens", "train", corpus.train, "uint16", Sharding(8000, 8000))
    builder = Builder([job], tiny_tokenizer, special_ids(tiny_tokenizer), 1)
    builder.process.join(120)
    with pytest.raises(UserError) as error:
        builder.check()
    assert str(error.value) == (
        f"cannot read {data / 'b.jsonl'}: line 7, column 10: not valid JSON: a string opens here "
        "and is never closed (fix or remove that line)"
    )
    built = sorted(p.name for p in (tmp_path / "tokens").iterdir())  # what came before the break
    shards = len(built) // 2
    assert shards >= 3 and built == [
        f"train-{k:05d}.{x}" for k in range(shards) for x in ("bin", "idx")
    ]
    builder.stop()


class Stopped:
    """A builder that has stopped on a broken file once ``failed``."""

    failed = False

    def check(self) -> None:
        if self.failed:
            raise UserError("cannot read b.jsonl: line 7")


def test_the_run_stops_at_the_step_after_the_builder_failed():
    """Not only at the shard it could not build: training could go on for hours first."""
    builder = Stopped()
    loader = SimpleNamespace(accum_steps=2, seek=lambda step: None)
    data = TrainData(*[None] * 7, loader, itertools.count(), "pack", 8, True, builder)
    batches = data.batches(0)
    assert next(batches) == [0, 1]
    builder.failed = True
    with pytest.raises(UserError, match="line 7"):
        next(batches)


@pytest.mark.e2e
def test_a_break_met_while_training_stops_the_run_and_keeps_its_checkpoints(
    train_env, tmp_path, monkeypatch
):
    """The builder meets the break after training began (some 18 shards of 6,000 characters,
    0.25 s each): the run stops at its next step with the one line, exit 2; the checkpoints it saved
    are intact and nothing else was written."""
    data = folder_breaking_late(tmp_path / "data", 3000)
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "first=6000,largest=6000,whole=0,delay=0.25")
    out = tmp_path / "out"
    args = ["--dataset", str(data), "--max-steps", "400", "--save-every", "2", "--num-proc", "1"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    result = train_here(train_env, tiny_args(train_env, out, *args))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: cannot read {data / 'b.jsonl'}: line 7, column 10: not valid JSON: a string "
        "opens here and is never closed (fix or remove that line)"
    ]
    assert "being built in the background" in result.stdout
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and all(verify_checkpoint(p) is None for p in saved)
    assert not (out / "llama_model.pth").exists()
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock", "checkpoints", "metrics.jsonl", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
