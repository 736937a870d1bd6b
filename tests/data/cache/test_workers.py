"""data/cache/workers.py: a worker frames each document as [BOT] + tokens + [EOT], writes a shard
as .bin (the tokens) and .idx (where each document ends) or nothing at all, and yields the CPU to
training; it starts without torch."""

import os
import subprocess
import sys

import numpy as np
import pytest

from llama_ddp.data.cache import workers
from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import special_ids
from tests.helpers.runs import ROOT

TEXTS = ["def f(x):\n    return x", "", "[EOT] typed in a text is text", "héllo wörld"]


@pytest.fixture()
def encoder(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(workers, "_encoder", None)
    workers.init_encoder(tiny_tokenizer.to_str(), special_ids(tiny_tokenizer))
    return text_encoder(tiny_tokenizer), special_ids(tiny_tokenizer)


def test_each_document_is_framed_by_bot_and_eot(encoder):
    tok, ids = encoder
    flat, lengths = workers.encode_chunk(tok, TEXTS, ids, np.dtype(np.uint16))
    expected = [[ids.bot, *tok.encode(t, add_special_tokens=False).ids, ids.eot] for t in TEXTS]
    assert lengths.tolist() == [len(e) for e in expected]
    assert flat.dtype == np.uint16 and flat.tolist() == sum(expected, [])
    assert ids.eot not in expected[2][1:-1]  # the typed "[EOT]" is text, not the control token


def test_a_shard_is_its_tokens_and_document_ends(encoder, tmp_path, monkeypatch):
    tok, ids = encoder
    monkeypatch.setattr(workers, "_CHUNK_DOCS", 3)  # offsets carried across chunks
    workers.write_shard(TEXTS, tmp_path / "train-00000", "uint16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-00000.bin", "train-00000.idx"]
    flat, lengths = workers.encode_chunk(tok, TEXTS, ids, np.dtype(np.uint16))
    assert np.fromfile(tmp_path / "train-00000.bin", dtype=np.uint16).tolist() == flat.tolist()
    ends = np.fromfile(tmp_path / "train-00000.idx", dtype=np.int64).tolist()
    assert ends == [0, *np.cumsum(lengths).tolist()]


def test_a_failed_shard_leaves_no_file(encoder, tmp_path, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(workers, "encode_chunk", full)
    with pytest.raises(Exception, match="No space left on device"):
        workers.write_shard(TEXTS, tmp_path / "train-00000", "uint16")
    assert list(tmp_path.iterdir()) == []


def test_a_worker_runs_at_a_lower_priority_than_training():
    read, write = os.pipe()
    before = os.nice(0)
    pid = os.fork()
    if pid == 0:  # the child: a worker's niceness, written back to the test
        workers.lower_priority()
        os.write(write, str(os.nice(0)).encode())
        os._exit(0)
    os.close(write)
    assert os.waitpid(pid, 0)[1] == 0
    assert int(os.read(read, 16)) == min(before + 10, 19)
    assert os.nice(0) == before  # training keeps its own


def test_the_builder_and_its_workers_start_without_torch():
    """They are spawned: each runs train.py again (as __mp_main__, its command unrun) and
    imports its own modules, and none of it imports torch or datasets (seconds each; the
    builder imports datasets once it reads a corpus)."""
    code = (
        "import runpy, sys; runpy.run_path('train.py', run_name='__mp_main__'); "
        "import llama_ddp.data.cache.builder, llama_ddp.data.cache.workers; "
        "print([m for m in ('torch', 'datasets') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr
