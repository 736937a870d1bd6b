"""Where a local data file is broken: the file, the line (or Parquet row group) in it, what is
wrong there, and how to go on, as one line.

`datasets` reads local files through pyarrow, pandas and Python's decoders, whose errors count
rows from the start of a 10 MB block, or bytes from the start of a chunk, or name no file at all.
When reading fails, `DataFiles.reading` reads the split's files again here, in order, with the
standard library's decoders and parsers, and names the first break it finds: bytes that are not
UTF-8 (with their byte offset), a compressed file that ends early or is damaged, a line that is
not JSON or not a JSON object, a CSV row with more fields than the header or a quote never
closed, a Parquet file that is no Parquet file or has a damaged row group. A failure it finds no
break for is raised as it was. Nothing here runs unless reading failed.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import gzip
import itertools
import json
import logging
import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llama_ddp.errors import Interrupted, UserError, WriteFailed

_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
_BOM = b"\xef\xbb\xbf"
_BUILDERS = ("json", "text", "csv", "parquet")
_BUILDER_LOGGERS = [f"datasets.packaged_modules.{b}.{b}" for b in _BUILDERS]
_JSON_KINDS = {str: "text", bool: "true/false", int: "a number", float: "a number"}
_JSON_KINDS |= {list: "a list", dict: "an object"}
# json's own messages, said the way a person fixing the line reads them
_JSON_MESSAGES = {
    "Expecting value": "expected a JSON value",
    "Unterminated string starting at": "a string opens here and is never closed",
    "Invalid control character at": "a raw control character (a tab or a line break) in a string",
    "Extra data": "more text after the end of the JSON value",
}


class Break(Exception):
    """The first problem in a file: where (``line 12``, ``byte 1,100 (line 12, column 5)``),
    what is wrong, and how to go on."""

    def __init__(self, where: str, what: str, fix: str) -> None:
        super().__init__(f"{where}: {what}" if where else what)
        self.where, self.what, self.fix = where, what, fix


@dataclass(frozen=True)
class DataFiles:
    """The local files of one split, in the order `datasets` reads them, and its builder for
    them (``json``, ``text``, ``csv`` with ``sep``, ``parquet``)."""

    paths: tuple[str, ...]
    builder: str
    sep: str = ","

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Reads of these files in this block: an error that a break in one of them explains
        becomes one UserError naming the file, where and what; any other passes unchanged."""
        for builder in _BUILDER_LOGGERS:  # their "Failed to read ..." lines repeat what we raise
            logging.getLogger(builder).setLevel(logging.CRITICAL)
        try:
            yield
        except (UserError, WriteFailed, Interrupted, MemoryError):
            raise
        except Exception as exc:
            problem = self.first_break()
            if problem is None:
                raise
            raise UserError(problem) from exc

    def first_break(self) -> str | None:
        """The one line naming the first broken file's break, or None when every file reads."""
        for path in self.paths:
            found = find_break(Path(path), self.builder, self.sep)
            if found is not None:
                return f"cannot read {path}: {found} ({found.fix})"
        return None


def data_files_of(load_kwargs: dict, split: str) -> DataFiles | None:
    """The local files of ``split`` in `datasets.load_dataset` arguments (``train[:10%]`` reads
    those of ``train``); None for a hub dataset."""
    paths = load_kwargs.get("data_files", {}).get(split.split("[")[0])
    if not paths:
        return None
    return DataFiles(tuple(paths), load_kwargs["path"], load_kwargs.get("sep", ","))


def reading(files: DataFiles | None) -> contextlib.AbstractContextManager:
    """`DataFiles.reading` of ``files``; nothing to add for a hub dataset (None)."""
    return files.reading() if files is not None else contextlib.nullcontext()


def find_break(path: Path, builder: str, sep: str = ",") -> Break | None:
    """The first break in ``path`` read as ``builder`` reads it, or None."""
    check = {"json": _check_json, "text": _check_text, "csv": _check_csv}.get(builder)
    try:
        if builder == "parquet":
            _check_parquet(path)
        elif check is not None:
            check(path, sep)
    except Break as found:
        return found
    return None


# ----------------------------------------------------------------------------- bytes and text


def _compressed(path: Path) -> str | None:
    """The compression suffix of ``path`` (``.gz``, ``.bz2``, ``.xz``), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in _OPENERS else None


def _compression_break(path: Path, exc: BaseException, line: int = 0, offset: int = 0) -> Break:
    """A compressed stream's error, after ``line`` lines (``offset`` bytes) of text read whole."""
    suffix = _compressed(path)
    pack, cat, magic = _TOOLS[suffix]
    with open(path, "rb") as f:
        if not f.read(len(magic)).startswith(magic):
            return Break("", f"not {pack} data, though named {suffix}", "rename or compress it")
    at = f"after line {line} (byte {offset:,}) of its text" if line else "in its first lines"
    if isinstance(exc, EOFError):
        return Break(
            "",
            f"the file is truncated: its compressed data ends early, {at}",
            f"copy or download it again; `{cat} {path.name}` shows what it holds up to there",
        )
    return Break(
        "",
        f"its compressed data is damaged ({_one_line(exc)}) {at}",
        "copy or download it again, or compress its text again",
    )


def _one_line(exc: BaseException) -> str:
    text = "".join(c if c.isprintable() else " " for c in str(exc))
    return " ".join(text.split()) or type(exc).__name__


_TOOLS = {  # (compressor, its cat, the magic bytes its files begin with)
    ".gz": ("gzip", "zcat", b"\x1f\x8b"),
    ".bz2": ("bzip2", "bzcat", b"BZh"),
    ".xz": ("xz", "xzcat", b"\xfd7zXZ\x00"),
}


def _raw_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset of its start, its bytes) of the file's text: after
    decompression for a .gz/.bz2/.xz file. A compressed stream that ends early or is damaged is
    a Break at the line it stops in."""
    number, offset = 0, 0
    opener = _OPENERS.get(_compressed(path), open)
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, 1):
                yield number, offset, line
                offset += len(line)
    except _DECOMPRESSION_ERRORS as exc:
        if _compressed(path) is None:
            raise
        raise _compression_break(path, exc, number, offset) from None


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, decoded as UTF-8 (a byte order mark at the start is
    dropped, as `datasets` drops it); bytes that are not UTF-8 are a Break at their offset."""
    for number, offset, raw in _raw_lines(path):
        if number == 1 and raw.startswith(_BOM):
            raw, offset = raw[len(_BOM) :], offset + len(_BOM)
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            column = len(raw[: exc.start].decode("utf-8")) + 1
            bad = raw[exc.start : exc.end].hex(" ")
            compressed = _compressed(path)
            data = [s for s in path.suffixes if s.lower() not in _OPENERS][-1:] or [".txt"]
            iconv = "iconv -f utf-8 -t utf-8 -c"
            if compressed:
                pack, cat, _ = _TOOLS[compressed]
                drop = f"{cat} {path.name} | {iconv} | {pack} > fixed{data[0]}{compressed}"
            else:
                drop = f"{iconv} {path.name} > fixed{data[0]}"
            of = " of its decompressed text" if compressed else ""
            raise Break(
                f"byte {offset + exc.start:,}{of} (line {number}, column {column})",
                f"0x{bad} is not UTF-8 ({exc.reason})",
                f"save the file as UTF-8, or drop the bytes that are not: `{drop}`",
            ) from None


def _check_text(path: Path, sep: str) -> None:
    for _ in _text_lines(path):
        pass


# ----------------------------------------------------------------------------- JSON


def _json_error(exc: json.JSONDecodeError, line: int | None) -> Break:
    message = _JSON_MESSAGES.get(exc.msg, exc.msg[:1].lower() + exc.msg[1:])
    if line is None and not exc.doc[exc.pos :].strip():
        message = "the file ends inside the document (cut short?)"
    where = f"line {exc.lineno if line is None else line}, column {exc.colno}"
    fix = "fix the file there" if line is None else "fix or remove that line"
    return Break(where, f"not valid JSON: {message}", fix)


def _kind(value: object) -> str:
    return _JSON_KINDS.get(type(value), "null")


def _check_json(path: Path, sep: str) -> None:
    """JSON lines (one object a line), or one JSON document (its first line opens a list, or
    opens an object it does not close): a list of objects or of strings, or an object of columns.
    A key whose values change type is reported only when nothing else is wrong: newer `datasets`
    read it (as JSON text)."""
    lines = (item for item in _text_lines(path) if item[1].strip())
    first = next(lines, None)
    if first is None:
        return
    head = first[1].lstrip()
    if head.startswith("[") or (head.startswith("{") and not _parses(head)):
        _check_json_document(first, lines)
        return
    kinds: dict[str, tuple[str, int]] = {}
    changed: Break | None = None
    for number, text in itertools.chain([first], lines):
        try:
            row = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as exc:
            raise _json_error(exc, number) from None
        if not isinstance(row, dict):
            raise Break(
                f"line {number}",
                f'holds {_kind(row)}, not an object such as {{"text": "..."}}',
                "make every line one JSON object",
            )
        for key, value in row.items():
            if value is None:
                continue
            kind, (first_kind, where) = _kind(value), kinds.setdefault(key, (_kind(value), number))
            if changed is None and kind != first_kind:
                changed = Break(
                    f"line {number}",
                    f"{key!r} holds {kind} where line {where} holds {first_kind}",
                    "give that key values of one type on every line, or upgrade datasets",
                )
    if changed is not None:
        raise changed


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _check_json_document(first: tuple[int, str], rest: Iterator[tuple[int, str]]) -> None:
    """One JSON document over the whole file (``first``: its first non-blank line)."""
    number, text = first
    document = "\n" * (number - 1) + text + "".join(t for _, t in rest)
    try:
        value = json.loads(document)
    except json.JSONDecodeError as exc:
        raise _json_error(exc, None) from None
    shape = 'make it a list of objects such as {"text": "..."}, or JSON lines'
    if isinstance(value, list):
        kinds = {type(v) for v in value}
        if kinds - {dict} and kinds - {str}:
            raise Break("", "holds a list that mixes objects with other values", shape)
    elif not isinstance(value, dict):
        raise Break("", f"holds {_kind(value)}, not a list of objects", shape)


# ----------------------------------------------------------------------------- CSV


def _check_csv(path: Path, sep: str) -> None:
    """Rows of pandas' default dialect: more fields than the header, or a quoted field still
    open at the end of the file (its row read again, strictly)."""
    rows = csv.reader((t for _, t in _text_lines(path)), delimiter=sep)
    header, start, last = None, 1, None
    for row in rows:
        if row:
            last = start
            if header is None:
                header = len(row)
            elif len(row) > header:
                raise Break(
                    f"line {start}",
                    f"{len(row)} fields where the header has {header}",
                    f"quote the fields that hold {sep!r}, or remove the extra ones",
                )
        start = rows.line_num + 1
    if last is None:
        return
    tail = (t for n, t in _text_lines(path) if n >= last)
    try:
        for _ in csv.reader(tail, delimiter=sep, strict=True):
            pass
    except csv.Error as exc:
        if "end of data" not in str(exc):
            return
        raise Break(
            f"line {last}",
            'a quoted field opens in this row and is never closed (an unmatched ")',
            'close the quote, or double a " that is part of the text ("")',
        ) from None


# ----------------------------------------------------------------------------- Parquet


def _check_parquet(path: Path) -> None:
    """The footer, then each row group, read as `datasets` reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source: str | pa.BufferReader = str(path)
    if _compressed(path):
        try:
            with _OPENERS[_compressed(path)](path, "rb") as f:
                source = pa.BufferReader(f.read())
        except _DECOMPRESSION_ERRORS as exc:
            raise _compression_break(path, exc) from None
    try:
        parquet = pq.ParquetFile(source)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and others here
        raise Break(
            "",
            f"not a Parquet file, or its end is missing ({_one_line(exc)})",
            "write it again, or copy it again if a copy was cut short",
        ) from None
    meta, first = parquet.metadata, 0
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        try:
            parquet.read_row_group(g)
        except Exception as exc:
            raise Break(
                f"row group {g + 1} of {meta.num_row_groups} (rows {first + 1}-{first + rows})",
                f"damaged ({_one_line(exc)})",
                "write the file again",
            ) from None
        first += rows
