"""Train the byte-level BPE tokenizer on a corpus's train split and write one tokenizer.json.

    python tokenizer/train_tokenizer.py                       # the embedded sample corpus
    python tokenizer/train_tokenizer.py --dataset HuggingFaceFW/fineweb \\
        --dataset-config sample-10BT --streaming --max-docs 200000 --vocab-size 32000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llama_ddp.data.corpus import default_cache_dir, load_splits
from llama_ddp.data.tokenizer import train_tokenizer_file
from llama_ddp.errors import ArgumentParser, UserError, run_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="tokenizer/train_tokenizer.py", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="sample", help="'sample', a local path/glob, or a hub name")
    p.add_argument("--dataset-config", default=None, help="hub dataset configuration")
    p.add_argument("--split", default="train", help="split to train on")
    p.add_argument("--text-column", default="text", help="column holding the documents")
    p.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary size, special tokens included"
    )
    p.add_argument("--out", type=Path, default=Path("tokenizer/tokenizer.json"), help="output file")
    p.add_argument("--max-docs", type=int, default=None, help="train on the first N documents only")
    p.add_argument("--streaming", action="store_true", help="stream the dataset (no full download)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $LLAMA_DDP_CACHE or ~/.cache/llama_ddp",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_command(_train, argv)


def _train(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.max_docs is not None and args.max_docs < 1:
        raise UserError(f"--max-docs must be positive, got {args.max_docs}")
    corpus = load_splits(
        args.dataset,
        config=args.dataset_config,
        split=args.split,
        text_column=args.text_column,
        streaming=args.streaming,
        cache_dir=args.cache_dir or default_cache_dir(),
    )
    start = time.perf_counter()
    tok, docs = train_tokenizer_file(corpus.train, args.vocab_size, args.out, args.max_docs)
    seconds = time.perf_counter() - start
    print(
        f"trained a {tok.get_vocab_size()}-token tokenizer on {docs} documents in {seconds:.1f}s; "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
