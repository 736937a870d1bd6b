"""Token-cache test helpers: a small corpus, the datasets built from it, their items."""

import json
from pathlib import Path

import torch

from llama_ddp.data.cache import build as shards_mod
from llama_ddp.data.corpus import load_splits
from llama_ddp.data.pipeline import (
    IGNORE_INDEX,
    build_datasets,
)

BOT, EOT, PAD = 0, 1, 2


SHORT = "def add(a, b):"


LONG = "The quick brown fox jumps over the lazy dog. " * 20


def make_corpus(tmp_path: Path, texts: list[str], val_fraction: float = 0.2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return load_splits(str(path), val_fraction=val_fraction, cache_dir=tmp_path / "cache")


def framed(tok, text: str) -> list[int]:
    return [BOT, *tok.encode(text).ids, EOT]


def build(tmp_path, corpus, tok, **kwargs):
    kwargs.setdefault("seq_length", 16)
    kwargs.setdefault("packing", "pad")
    return build_datasets(corpus, tok, cache_dir=tmp_path / "cache", **kwargs)


def cache_folder(tmp_path) -> Path:
    (folder,) = (tmp_path / "cache").glob("tokens-*")
    return folder


def item(x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """The seq_length + 1 tokens an (x, y) pair was cut from, ignored targets shown as PAD."""
    return [*x.tolist(), PAD if y[-1] == IGNORE_INDEX else int(y[-1])]


SMALL = shards_mod.Sharding(first=100, largest=400)  # shards of 100, 200, then 400 characters


def batches_of(size: int, batch: int, shuffle: bool = True, seed: int = 0) -> list[list[int]]:
    """The loader's batch sampler for a test: ``size`` items in batches of ``batch`` (the last,
    partial one dropped), shuffled by ``seed`` unless ``shuffle`` is False."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)) if shuffle else None
    items = order.tolist() if order is not None else list(range(size))
    return [items[i : i + batch] for i in range(0, size - batch + 1, batch)]
