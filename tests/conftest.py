"""Shared test setup: offline mode, a tiny tokenizer and corpus, and tiny train.py runs.

Rule: bit equality only where the same kernels see the same inputs (rerun, same-shape resume, load);
two implementations or groupings: a tolerance and a comment why (CPU kernels vary by ISA and shape).
Greedy tokens of two implementations: tests/helpers/ties.py."""

import collections
import fcntl
import json
import multiprocessing
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from llama_ddp.data.tokenizer import train_tokenizer
from llama_ddp.data.tokenizer_files import save_tokenizer, special_ids
from llama_ddp.interop.hf import export_hf
from llama_ddp.interop.native import save_model
from tests.helpers.leftovers import pytest_testnodedown  # noqa: F401 (a hook: the controller's)
from tests.helpers.runs import (
    FORKSERVER_PRELOAD,
    TINY_TEXTS,
    WORDS,
    chat_source,
    full_run_args,
    tiny,
    tiny_args,
    train_here,
    write_gguf,
    write_task,
)
from tests.helpers.token_data import LONG, SHORT

# Session fixtures that train a model with train.py: a test that uses one is an e2e test.
TRAINING_FIXTURES = {"full_run", "task_run", "hub_run"}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def pytest_configure(config):
    """Under pytest-xdist (`make test`: one worker per core) each worker's torch, and the commands
    it starts, get that worker's share of the cores: two workers of two threads each on two cores
    oversubscribe them, and every tiny model's kernels wait for each other. Inductor's C++
    compiles too: at a share of one core it compiles in its own process, where its default (a
    pool of one compile process per core, each importing torch) cost ~15 s of CPU a cold compile
    (tests/train/test_muon.py's: 48 s of CPU with the pool, 33 s without)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        share = max(1, _cores() // int(workers))
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(share)  # the commands' inductor
        if "torch._inductor.config" in sys.modules:  # already read its environment
            sys.modules["torch._inductor.config"].compile_threads = share
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # start_ranks' processes


# The files that took longest (`pytest --durations`, 2 CPU cores), longest first: each is mostly
# torchrun launches, killed and resumed runs, or compiles. Only an order: a file not named here
# runs after them, those with more e2e tests first. The two files with `alone` tests lead, those
# tests first in them: at the start the two run one after the other, each on both cores, and no
# worker idles later while an `alone` test waits for the other's test to end (20-30 s of a core).
LONGEST_FILES = (
    "train/sizing/test_auto.py", "train/budget/test_budget.py",
    "train/test_resume.py", "train/test_train.py", "train/test_trainer.py",
    "train/test_muon.py",
    "train/test_run.py", "train/test_validation.py", "train/test_speed.py", "train/test_cli.py",
)  # fmt: skip


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist a test marked `alone` (a wall-clock budget it must keep, on 2 cores
    already busy with its own two ranks) runs while no other worker runs one: a readers-writer
    lock over each test's setup, call and teardown, its module fixtures' included. The gate
    keeps new tests from starting while an `alone` test waits for those running to end."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return (yield)
    stem = Path(tempfile.gettempdir()) / f"llama_ddp-tests-{run}"
    alone = item.get_closest_marker("alone") is not None
    with open(f"{stem}.gate", "a") as gate, open(f"{stem}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)


def _longest_first(items):
    tests = Path(__file__).parent
    named = {tests / name: i for i, name in enumerate(LONGEST_FILES)}
    e2e = [item for item in items if "e2e" in item.keywords and "gpu" not in item.keywords]
    weight = collections.Counter(item.path for item in e2e)
    return lambda item: (
        named.get(item.path, len(named)), -weight[item.path], str(item.path),
        item.get_closest_marker("alone") is None,
    )  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Every test that trains through a session fixture is marked e2e (so that `-m "not e2e"`
    trains nothing); `gpu` tests skip, never fail, on a machine without CUDA. Under pytest-xdist
    the files with the most e2e tests come first (xdist's `--dist loadfile` hands out whole files
    in this order, so the longest start first and short ones fill the end)."""
    unmarked = [
        item.nodeid
        for item in items
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())) and "e2e" not in item.keywords
    ]
    if unmarked:
        raise pytest.UsageError(f"tests that train a model must be marked e2e: {unmarked}")
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        items.sort(key=_longest_first(items))  # stable: a file's own order stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """Commands run in the test process cache what they make (a GGUF file's tokenizer, corpora)
    in the session's folder, never in the user's ~/.cache."""
    saved = os.environ.get("LLAMA_DDP_CACHE")
    os.environ["LLAMA_DDP_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        del os.environ["LLAMA_DDP_CACHE"]
    else:
        os.environ["LLAMA_DDP_CACHE"] = saved


@pytest.fixture(scope="session")
def tiny_texts():
    return list(TINY_TEXTS)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer with the special tokens, trained in a fraction of a second."""
    return train_tokenizer(TINY_TEXTS, vocab_size=400)


@pytest.fixture(scope="session")
def train_env(tmp_path_factory) -> dict:
    """A small synthetic corpus with documents of uneven length, a tokenizer trained on it and a
    private data cache: everything `train.py --preset tiny` needs in a few seconds."""
    root = tmp_path_factory.mktemp("train_env")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90))) for _ in range(500)]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = root / "tokenizer.json"
    save_tokenizer(train_tokenizer(docs, 320), tokenizer)
    env = {**os.environ, "LLAMA_DDP_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    return {"root": root, "corpus": corpus, "tokenizer": tokenizer, "env": env}


@pytest.fixture(scope="session")
def chat_model(train_env, tmp_path_factory) -> dict:
    """`chat_source` with a tokenizer of the train_env corpus, and its GGUF file."""
    root = tmp_path_factory.mktemp("chat")
    texts = [json.loads(line)["text"] for line in train_env["corpus"].read_text().splitlines()]
    source = chat_source(root / "source", texts)
    return {"source": source, "gguf": write_gguf(source, root / "gguf" / "tiny-chat-q8.gguf")}


@pytest.fixture(scope="session")
def full_run(train_env, tmp_path_factory):
    """train.py on the tiny preset for 12 steps, with the hf/ export; its stdout in stdout.txt."""
    out = tmp_path_factory.mktemp("full")
    result = train_here(train_env, full_run_args(train_env, out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (out / "stdout.txt").write_text(result.stdout)
    return out


@pytest.fixture(scope="session")
def task_run(train_env, tmp_path_factory):
    """A tiny run of 10 steps scoring a task file at steps 0, 4, 8 and 10 (the end), with
    TensorBoard."""
    root = tmp_path_factory.mktemp("task_run")
    task = write_task(root / "words.jsonl")
    out = root / "out"
    args = [a for a in tiny_args(train_env, out) if a != "--no-export-hf"]
    args += ["--max-steps", "10", "--eval-every", "4", "--save-every", "4", "--keep-last", "3"]
    args += ["--eval-tasks", str(task), "--eval-limit", "10", "--log-to", "tensorboard"]
    result = train_here(train_env, args)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, task


@pytest.fixture(scope="session")
def hub_run(train_env, chat_model, tmp_path_factory):
    """train.py --init-from DIR --tokenizer DIR on a chat model's folder (tied embeddings, a chat
    template, an unk token), its documents framed by <|endoftext|> (--bot-token by name,
    --eot-token by id) rather than its BOS/EOS, then the same command again (a finished run:
    resume wins)."""
    source, out = chat_model["source"], tmp_path_factory.mktemp("hub") / "out"
    args = ["--init-from", str(source), "--tokenizer", str(source), "--dataset",
            str(train_env["corpus"]), "--seq-length", "48", "--batch-size", "8", "--max-steps",
            "10", "--eval-every", "5", "--log-every", "1", "--bot-token", "<|endoftext|>",
            "--eot-token", "0", "--out-dir", str(out)]  # fmt: skip
    first = train_here(train_env, args)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = train_here(train_env, args)
    assert again.returncode == 0, again.stderr[-3000:]
    return source, out, args, first, again


@pytest.fixture
def texts(tiny_texts):
    return [*tiny_texts[:4], SHORT, LONG] * 3


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and lose a lot on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # héllo wörld\n" for i in range(300)]
    return train_tokenizer(texts, 320)


@pytest.fixture(scope="module")
def ids(tok):
    return special_ids(tok)


@pytest.fixture(scope="module")
def out(tok, tmp_path_factory):
    """A saved tiny model: out/llama_model.pth (+ .json, tokenizer.json) and out/hf/."""
    out = tmp_path_factory.mktemp("run") / "out"
    tok_path = out.parent / "tokenizer.json"
    save_tokenizer(tok, tok_path)
    model = tiny(tok.get_vocab_size())
    save_model(model, model.config, out, tok_path)
    export_hf(model, out / "hf", tok_path)
    return out
