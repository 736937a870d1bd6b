"""GGUF files (llama.cpp's one-file format) as a source: ``--init-from``, ``--tokenizer`` and
``generate --model`` take a ``.gguf`` file. It is read through transformers' GGUF loader, which
dequantizes every tensor (Q4_1, Q8_0, F16, ...) to the dtype asked for, and needs the ``gguf`` and
``accelerate`` packages: ``pip install 'llama_ddp[gguf]'``.

This module hands back what transformers reads, in transformers' terms (a config.json dict, its
tensor names, a tokenizer folder as ``save_pretrained`` writes it); ``weights.read_source`` turns
them into ours and refuses what is not a plain Llama. No file is unpickled: GGUF holds no code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llama_ddp.errors import UserError

MAGIC = b"GGUF"
INSTALL = "pip install 'llama_ddp[gguf]'"
_NEEDS = ("transformers", "gguf", "accelerate")


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
