"""Data pipeline throughput on the sample corpus: per-item tokenization vs the token cache.

    python bench/bench_data.py --json bench/results/data.json

a      the article's approach: a Dataset that tokenizes its document in ``__getitem__`` and
       builds the padded tensors, read through a DataLoader in batches of --batch-size;
b1     building our token cache from scratch: batched tokenization of both splits, to disk, in
       this process (the tokenizer's own threads) or, b1-num_proc=N, in N worker processes
       (num_proc=1: this process on one core); tokens per CPU-second (this process's and its
       workers', whatever else the machine runs) is the rate of one core;
b2-*   reading PretrainingDataset (pad) / PackedDataset (pack) from the warm cache through
       shuffled batches + make_loader.
tokens/s counts the real (non-PAD) input tokens a loader hands out (for b1: tokens cached);
tokenized/s counts what the tokenizer produced (a tokenizes whole documents, then clips).
Loaders use num_workers=0: every loader figure is one process's work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from llama_ddp.data.corpus import load_splits
from llama_ddp.data.pipeline import (
    IGNORE_INDEX,
    build_datasets,
    make_loader,
)
from llama_ddp.data.tokenizer import train_tokenizer
from llama_ddp.data.tokenizer_files import special_ids


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


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the cache's workers)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return sum(r.ru_utime + r.ru_stime for r in (own, children))


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
    p.add_argument(
        "--num-proc",
        default="",
        help="comma list: also time cache builds with N tokenizer worker processes (1: this "
        "process, the tokenizer's own threads off: one core)",
    )
    p.add_argument("--dataset", default="sample", help="as train.py's (default: sample)")
    p.add_argument("--builds-only", action="store_true", help="time the cache builds (b1) only")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    L, B = args.seq_length, args.batch_size
    torch.set_num_threads(1)  # a loader process is one thread; keep the figures comparable
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        corpus = load_splits(args.dataset, cache_dir=cache)
        texts = list(corpus.train)
        start = time.perf_counter()
        tok = train_tokenizer(texts[:20000], args.vocab_size)
        tokenizer_seconds = time.perf_counter() - start
        pad = special_ids(tok).pad

        if not args.builds_only:
            per_item = PerItemDataset(texts, tok, L)
            rows["a"] = iterate(DataLoader(per_item, batch_size=B, drop_last=True), pad, 0.0)
            rows["a"]["tokenized"] = per_item.encoded

        for num_proc in [None, *(int(n) for n in args.num_proc.split(",") if n)]:
            folder = cache / f"build-{num_proc}"
            parallel = os.environ.get("TOKENIZERS_PARALLELISM")
            if num_proc == 1:  # one core: the Rust tokenizer's threads off
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            start, cpu = time.perf_counter(), cpu_seconds()
            build_datasets(
                corpus, tok, seq_length=L, packing="pad", cache_dir=folder, num_proc=num_proc
            )
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            if num_proc == 1:
                os.environ.pop("TOKENIZERS_PARALLELISM")
                if parallel is not None:
                    os.environ["TOKENIZERS_PARALLELISM"] = parallel
            totals = [json.loads(p.read_text()) for p in folder.glob("tokens-*/*.json")]
            tokens = sum(t["tokens"] for t in totals)
            name = "b1" + (f"-num_proc={num_proc}" if num_proc else "")
            rows[name] = {
                "seconds": seconds,
                "sequences": sum(t["docs"] for t in totals),
                "tokens": tokens,
                "tokenized": tokens,
                "processes": num_proc or os.cpu_count(),
                "cpu_seconds": cpu,  # this process's and its (finished) workers'
                "tokens_per_cpu_second": tokens / cpu,
            }

        for packing in () if args.builds_only else ("pad", "pack"):
            train, _ = build_datasets(corpus, tok, seq_length=L, packing=packing, cache_dir=folder)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
            sampler = [order[i : i + B] for i in range(0, len(order) - B + 1, B)]
            loader = make_loader(train, sampler, padded=packing == "pad")
            rows[f"b2-{packing}"] = iterate(loader, pad, args.min_seconds)

    for r in rows.values():
        r["sequences_per_s"] = r["sequences"] / r["seconds"]
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        if "tokenized" in r:
            r["tokenized_per_s"] = r["tokenized"] / r["seconds"]
        if "processes" in r:
            r["tokens_per_s_per_process"] = r["tokens_per_s"] / r["processes"]
    print(
        f"{args.dataset}: {len(texts)} train documents, {sum(map(len, texts)) / 1e6:.1f} MB; "
        f"seq_length {L}, batch {B}; {args.vocab_size}-token tokenizer trained in "
        f"{tokenizer_seconds:.1f}s; {os.cpu_count()} CPUs"
    )
    print(f"{'':14} {'seconds':>8} {'sequences/s':>12} {'tokens/s':>12} {'tokenized/s':>12}")
    for name, r in rows.items():
        tokenized = f"{r['tokenized_per_s']:12,.0f}" if "tokenized" in r else ""
        per_process = ""
        if "processes" in r:
            per_process = f" ({r['tokens_per_cpu_second']:,.0f} per CPU-second)"
        print(
            f"{name:14} {r['seconds']:8.2f} {r['sequences_per_s']:12,.0f} "
            f"{r['tokens_per_s']:12,.0f} {tokenized}{per_process}"
        )
    if args.builds_only:
        return
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
