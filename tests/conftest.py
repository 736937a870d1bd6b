"""Shared test setup: offline mode, a tiny tokenizer and corpus, and tiny train.py runs."""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# No test may reach the network: offline mode makes an unknown hub name fail at once. Set before
# any test module imports `datasets`, which reads these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]

TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 🦙",
    "for i in range(10):\n\tprint(i)  # count\n",
] * 8


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, never fail, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_texts():
    return list(TINY_TEXTS)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer with the special tokens, trained in a fraction of a second."""
    from llama_ddp.tokenizer import train_tokenizer

    return train_tokenizer(TINY_TEXTS, vocab_size=400)


# Tiny training runs: a corpus of uneven documents, its tokenizer, and train.py's flags for them.
WORDS = (
    "the a cat dog runs jumps over under big small red blue house tree river stone and then "
    "because while if else return def class import from print value"
).split()


@pytest.fixture(scope="session")
def train_env(tmp_path_factory) -> dict:
    """A small synthetic corpus with documents of uneven length, a tokenizer trained on it and a
    private data cache: everything `train.py --preset tiny` needs in a few seconds."""
    from llama_ddp.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("train_env")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90))) for _ in range(500)]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = root / "tokenizer.json"
    save_tokenizer(train_tokenizer(docs, 320), tokenizer)
    env = {**os.environ, "LLAMA_DDP_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    return {"root": root, "corpus": corpus, "tokenizer": tokenizer, "env": env}


def tiny_args(train_env: dict, out_dir: Path, *extra: str) -> list[str]:
    return [
        "--preset", "tiny", "--dataset", str(train_env["corpus"]),
        "--tokenizer", str(train_env["tokenizer"]), "--seq-length", "48",
        "--batch-size", "8", "--max-steps", "8", "--log-every", "1",
        "--out-dir", str(out_dir), "--no-export-hf", *extra,
    ]  # fmt: skip


def run_train(train_env: dict, args: list[str], torchrun: list[str] | None = None, **kw):
    """Run train.py in a subprocess (under torchrun when given its flags)."""
    if torchrun is None:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, str(ROOT / "train.py")]
        cmd += args
    return subprocess.run(
        cmd, env=train_env["env"], capture_output=True, text=True, timeout=300, **kw
    )


def load_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(out_dir) / "llama_model.pth", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rewrite_manifest(checkpoint: Path, drop: tuple[str, ...] = ()) -> None:
    """Make a checkpoint's manifest match the files in it (minus ``drop``), as someone crafting
    a checkpoint would: every checksum then agrees."""
    import hashlib

    manifest_path = Path(checkpoint) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(Path(checkpoint).iterdir())
        if p.name != "manifest.json" and p.name not in drop
    }
    manifest_path.write_text(json.dumps(manifest))
