"""Hugging Face hub names where a path is expected (``--init-from``, ``--tokenizer``,
``generate --model``): a repository id such as ``HuggingFaceTB/SmolLM2-135M`` that is not a local
path is fetched with ``huggingface_hub.snapshot_download`` (only the files we read), or found in
the hub cache; offline (``HF_HUB_OFFLINE=1``), only the cache is used.
"""

from __future__ import annotations

import re
from pathlib import Path

from llama_ddp.errors import UserError

# What each use reads: a model's shape and weights (with its tokenizer, for generation), or a
# tokenizer alone (with its roles, special tokens, chat template and generation defaults).
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
]
MODEL_FILES = [
    "config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LOCAL_SUFFIXES = (".json", ".pth", ".pt", ".safetensors", ".gguf", ".jinja")


def is_repo_id(name: str | Path) -> bool:
    """``owner/name`` that is no local path: a file name (``out/llama_model.pth``) or a folder
    under an existing one (a typo such as ``out/smal``) stays a path, reported as missing."""
    text = str(name)
    return (
        _REPO_ID.fullmatch(text) is not None
        and not text.endswith(_LOCAL_SUFFIXES)
        and not Path(text.split("/")[0]).exists()
    )


def local_path(name: str | Path, files: list[str], what: str) -> Path:
    """``name`` itself, or for a hub repository id the local folder holding its ``files``."""
    if not is_repo_id(name):
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name), allow_patterns=files))
    except Exception as exc:  # offline, unknown, gated, or the hub unreachable: all one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{what} {name} is neither a local path nor a hub repository this machine can "
            f"fetch ({type(exc).__name__}: {reason}) (check the path or name; offline, "
            "download it once with network access)"
        ) from exc
