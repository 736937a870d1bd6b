"""Data pipeline throughput on the sample corpus: per-item tokenization vs the token cache.

    python bench/bench_data.py --json bench/data.json

a      the article's approach: a Dataset that tokenizes its document in ``__getitem__`` and
       builds the padded tensors, read through a DataLoader in batches of --batch-size;
b1     building our token cache from scratch: batched tokenization of both splits, to disk;
b2-*   reading PretrainingDataset (pad) / PackedDataset (pack) from the warm cache through
       GlobalBatchSampler + make_loader.
tokens/s counts the real (non-PAD) input tokens a loader hands out (for b1: tokens cached);
tokenized/s counts what the tokenizer produced (a tokenizes whole documents, then clips).
Loaders use num_workers=0: every loader figure is one process's work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from llama_ddp.corpus import load_splits
from llama_ddp.data import (
    IGNORE_INDEX,
    GlobalBatchSampler,
    build_datasets,
    make_loader,
)
from llama_ddp.tokenizer import special_ids, train_tokenizer


class PerItemDataset(Dataset):
    """The reference approach: tokenize one whole document per ``__getitem__``, then clip."""

    def __init__(self, texts: list[str], tok, seq_length: int) -> None:
        self.texts, self.tok, self.seq_length = texts, tok, seq_length
        self.ids = special_ids(tok)
        self.encoded = 0  # tokens the tokenizer produced, clipped ones included

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [self.ids.bot, *self.tok.encode(self.texts[i]).ids, self.ids.eot]
        self.encoded += len(tokens)
        tokens = tokens[: self.seq_length + 1]
        tokens += [self.ids.pad] * (self.seq_length + 1 - len(tokens))
        t = torch.tensor(tokens)
        y = t[1:].clone()
        y[y == self.ids.pad] = IGNORE_INDEX
        return t[:-1], y


def iterate(loader, pad_id: int, min_seconds: float) -> dict:
    """Whole passes over ``loader`` until ``min_seconds`` have elapsed."""
    sequences = tokens = passes = 0
    start = time.perf_counter()
    while passes == 0 or time.perf_counter() - start < min_seconds:
        for batch in loader:  # the article's (x, y) pairs, or our Batches
            x = batch[0] if isinstance(batch, (list, tuple)) else batch.x
            sequences += x.shape[0]
            tokens += int((x != pad_id).sum())
        passes += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "passes": passes, "sequences": sequences, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-seconds", type=float, default=2.0, help="per warm-cache measurement")
    p.add_argument("--num-proc", type=int, default=None, help="also time a build with N workers")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    L, B = args.seq_length, args.batch_size
    torch.set_num_threads(1)  # a loader process is one thread; keep the figures comparable
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        corpus = load_splits("sample", cache_dir=cache)
        texts = list(corpus.train)
        start = time.perf_counter()
        tok = train_tokenizer(texts, args.vocab_size)
        tokenizer_seconds = time.perf_counter() - start
        pad = special_ids(tok).pad

        per_item = PerItemDataset(texts, tok, L)
        rows["a"] = iterate(DataLoader(per_item, batch_size=B, drop_last=True), pad, 0.0)
        rows["a"]["tokenized"] = per_item.encoded

        for num_proc in [None] if args.num_proc is None else [None, args.num_proc]:
            folder = cache / f"build-{num_proc}"
            start = time.perf_counter()
            build_datasets(
                corpus, tok, seq_length=L, packing="pad", cache_dir=folder, num_proc=num_proc
            )
            seconds = time.perf_counter() - start
            splits = json.loads(next(folder.glob("tokens-*/meta.json")).read_text())["splits"]
            tokens = sum(s["tokens"] for s in splits.values())
            rows["b1" + (f"-num_proc={num_proc}" if num_proc else "")] = {
                "seconds": seconds,
                "sequences": sum(s["docs"] for s in splits.values()),
                "tokens": tokens,
                "tokenized": tokens,
            }

        for packing in ("pad", "pack"):
            train, _ = build_datasets(corpus, tok, seq_length=L, packing=packing, cache_dir=folder)
            sampler = GlobalBatchSampler(len(train), global_batch=B, micro_batch=B)
            rows[f"b2-{packing}"] = iterate(make_loader(train, sampler), pad, args.min_seconds)

    for r in rows.values():
        r["sequences_per_s"] = r["sequences"] / r["seconds"]
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        if "tokenized" in r:
            r["tokenized_per_s"] = r["tokenized"] / r["seconds"]
    print(
        f"sample corpus: {len(texts)} train documents, {sum(map(len, texts)) / 1e6:.1f} MB; "
        f"seq_length {L}, batch {B}; {args.vocab_size}-token tokenizer trained in "
        f"{tokenizer_seconds:.1f}s; {os.cpu_count()} CPUs"
    )
    print(f"{'':14} {'seconds':>8} {'sequences/s':>12} {'tokens/s':>12} {'tokenized/s':>12}")
    for name, r in rows.items():
        tokenized = f"{r['tokenized_per_s']:12,.0f}" if "tokenized" in r else ""
        print(
            f"{name:14} {r['seconds']:8.2f} {r['sequences_per_s']:12,.0f} "
            f"{r['tokens_per_s']:12,.0f} {tokenized}"
        )
    ratios = {
        "warm pad loader / per-item": rows["b2-pad"]["tokens_per_s"] / rows["a"]["tokens_per_s"],
        "warm pack loader / per-item": rows["b2-pack"]["tokens_per_s"] / rows["a"]["tokens_per_s"],
        "cache build / per-item, tokenization": rows["b1"]["tokenized_per_s"]
        / rows["a"]["tokenized_per_s"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.1f}x")
    if args.json:
        result = {
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "seq_length": L, "batch_size": B, "vocab_size": args.vocab_size,
            "train_documents": len(texts), "tokenizer_train_seconds": tokenizer_seconds,
            "rows": rows, "ratios": ratios,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
