"""GGUF files (llama.cpp's one-file format) as a source: ``--init-from``, ``--tokenizer`` and
``generate --model`` take a ``.gguf`` file. It is read through transformers' GGUF loader, which
dequantizes every tensor (Q4_1, Q8_0, F16, ...) to the dtype asked for, and needs the ``gguf`` and
``accelerate`` packages: ``pip install 'llama_ddp[gguf]'``.

This module hands back what transformers reads, in transformers' terms (a config.json dict, its
tensor names, a tokenizer folder as ``save_pretrained`` writes it); ``weights.read_source`` turns
them into ours and refuses what is not a plain Llama. No file is unpickled: GGUF holds no code.
Before either reads a file, `check_header` walks its header and bounds every count and offset by
the file's size: a file cut short or a crafted count is one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import mmap
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_ddp.errors import UserError

if TYPE_CHECKING:  # imported where weights are read: a tokenizer worker imports no torch
    import torch

MAGIC = b"GGUF"
INSTALL = "pip install 'llama_ddp[gguf]'"
_NEEDS = ("transformers", "gguf", "accelerate")
# GGUF's value types: struct format of each scalar; 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file meant as GGUF: named ``*.gguf``, or starting with its magic."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == MAGIC


def _checked(path: Path, what: str) -> None:
    """A UserError unless ``path`` is a GGUF file and the packages that read it are installed."""
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise UserError(
                f"{what} {path} is named .gguf but is not a GGUF file (it does not start with "
                "GGUF: re-download it)"
            )
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"{what} {path} is a GGUF file; reading it needs the {', '.join(missing)} "
            f"package(s) ({INSTALL})"
        )
    check_header(path, what)


class _BadHeader(Exception):
    """Where and why a GGUF header cannot be what it says."""


class _Header:
    """A cursor over a GGUF file's bytes that refuses to read past its end, and any count of
    items more than the bytes left could hold (each item takes at least ``least`` bytes)."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise _BadHeader(f"truncated at byte {len(self.data):,} (its header ends early)")
        value = struct.unpack_from("<" + fmt, self.data, self.at)[0]
        self.at += size
        return value

    def count(self, what: str, least: int) -> int:
        at, n = self.at, self.take("Q")
        left = len(self.data) - self.at
        if n * least > left:
            raise _BadHeader(
                f"{what} at byte {at:,} claims {n:,} items, more than the {left:,} bytes after "
                "it could hold: the file is cut short, or the count is corrupt"
            )
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        self.at += n
        return bytes(self.data[self.at - n : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        if kind == _STRING:
            return self.string(key)
        if kind == _ARRAY:
            item = self.take("I")
            least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
            n = self.count(key, least)
            if item in _SCALARS:
                self.at += n * least  # the bound was checked: nothing to read one by one
                return n
            for _ in range(n):
                self.value(item, key)
            return n
        if kind not in _SCALARS:
            raise _BadHeader(f"{key} at byte {self.at - 4:,} has an unknown value type {kind}")
        return self.take(_SCALARS[kind])


def check_header(path: Path, what: str) -> None:
    """A UserError naming ``path`` unless its GGUF header (counts, keys, values, tensor infos)
    lies within the file and every tensor's data does too: a file cut short or a count no file
    could hold is refused here, before a reader trusts it."""
    from gguf.constants import GGML_QUANT_SIZES

    with path.open("rb") as f, contextlib.ExitStack() as stack:
        size = path.stat().st_size
        data = (
            stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else b""
        )
        h = _Header(data)
        try:
            h.take("4s")
            version = h.take("I")
            if version not in (2, 3):
                raise _BadHeader(f"version {version} (llama_ddp reads GGUF versions 2 and 3)")
            tensors = h.count("the tensor count", 1)  # its infos come after the keys'
            keys = h.count("the key/value count", 1)
            alignment = 32
            for _ in range(keys):
                key = h.string("a key")
                value = h.value(h.take("I"), key)
                if key == "general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            extents = []
            for _ in range(tensors):
                name = h.string("a tensor name")
                dims = h.take("I")
                if dims > 8:
                    raise _BadHeader(f"tensor {name} has {dims} dimensions")
                shape = [h.take("Q") for _ in range(dims)]
                kind, offset = h.take("I"), h.take("Q")
                block, block_bytes = GGML_QUANT_SIZES.get(kind, (1, 0))
                elements = 1
                for n in shape:
                    elements *= n
                extents.append((name, offset, elements // block * block_bytes))
            start = -(-h.at // alignment) * alignment
            for name, offset, nbytes in extents:
                if start + offset + nbytes > size:
                    raise _BadHeader(
                        f"tensor {name}'s data ends at byte {start + offset + nbytes:,}, past "
                        f"the end of the file ({size:,} bytes): truncated"
                    )
        except _BadHeader as exc:
            raise UserError(
                f"{what} {path} is not a valid GGUF file: {exc} (copy or download it again)"
            ) from None


@contextlib.contextmanager
def _transformers_errors(path: Path, what: str) -> Iterator[None]:
    """transformers' refusals of a file (an architecture or a tensor type it cannot read) as one
    line."""
    try:
        yield
    except (ValueError, OSError, KeyError, ImportError) as exc:
        text = str(exc).strip().splitlines()
        reason = text[0] if text else type(exc).__name__
        raise UserError(
            f"{what} {path}: transformers cannot read this GGUF file ({reason}) (use a Llama "
            "GGUF, or the model's safetensors folder)"
        ) from exc


def read_gguf_config(path: str | Path, what: str = "model") -> dict[str, Any]:
    """The config.json that transformers makes of the GGUF file's metadata (tensors unread)."""
    path = Path(path)
    _checked(path, what)
    from transformers import AutoConfig

    with _transformers_errors(path, what):
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()


def read_gguf_weights(path: str | Path, what: str = "model") -> dict[str, torch.Tensor]:
    """The GGUF file's weights under transformers' names, dequantized to fp32 (the dtype weights
    train in; generation casts them to its ``--dtype``)."""
    path = Path(path)
    _checked(path, what)
    import torch
    from transformers import AutoModelForCausalLM

    with _transformers_errors(path, what):
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return {name: t.detach() for name, t in model.state_dict().items()}


def write_tokenizer_folder(path: str | Path, folder: str | Path, what: str = "tokenizer") -> Path:
    """The GGUF file's tokenizer as a tokenizer folder (tokenizer.json, tokenizer_config.json with
    its roles, unk token and add_bos_token, chat_template.jinja), written by transformers'
    ``save_pretrained`` into ``folder`` (replaced whole, through a temporary folder)."""
    path, folder = Path(path), Path(folder)
    _checked(path, what)
    from transformers import AutoTokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # transformers also reads a tokenizer_config.json beside the file (a run folder's
        # OUT/model.gguf has ours), which loses the file's own BOS/EOS: the file is read alone.
        with _transformers_errors(path, what), tempfile.TemporaryDirectory() as alone:
            (Path(alone) / path.name).symlink_to(path.resolve())
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
        tokenizer.save_pretrained(tmp)
        _keep_the_files_vocabulary(tmp / "tokenizer.json", path)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _keep_the_files_vocabulary(tokenizer_json: Path, path: Path) -> None:
    """transformers' GGUF converter adds GPT-2's ``<|endoftext|>`` to a byte-level tokenizer that
    lacks it: a token past the file's own ids is dropped, so the folder's vocabulary is the
    file's (and fits the file's model)."""
    import gguf

    count = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    kept = [token for token in added if token["id"] < count]
    if len(kept) < len(added):
        data["added_tokens"] = kept
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
