"""data/cache/read.py: the token cache: keyed by corpus, tokenizer and roles, reused, waited for
(a long wait reported, and bounded where a peer waits in a collective)."""

import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_ddp.data.cache import workers
from llama_ddp.data.cache.read import Patience, ShardedSplit, token_caches
from llama_ddp.data.pipeline import IGNORE_INDEX
from llama_ddp.data.tokenizer import train_tokenizer
from llama_ddp.data.tokenizer_files import SpecialIds, special_ids
from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import runtime
from llama_ddp.errors import DataWaitTimeout, UserError
from llama_ddp.files.preparation import Preparation
from llama_ddp.train.run import waiting_patience
from tests.helpers.runs import free_port, start_ranks
from tests.helpers.token_data import SHORT, build, cache_folder, framed, item, make_corpus


def test_the_roles_frame_and_pad_documents_and_key_the_cache(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    roles = SpecialIds(bot=5, eot=6, pad=6)  # a hub tokenizer's BOS/EOS, padding with the EOS
    train, _ = build(tmp_path, corpus, tiny_tokenizer, special=roles)
    x, y = train[list(corpus.train).index(SHORT)]
    t = [5, *tiny_tokenizer.encode(SHORT).ids, 6]
    assert x.tolist() == t + [6] * (16 - len(t))
    assert y.tolist() == t[1:] + [IGNORE_INDEX] * (17 - len(t))  # padding masked by position
    build(tmp_path, corpus, tiny_tokenizer)  # our [BOT]/[EOT]/[PAD]: another cache
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2


def test_cache_is_reused_without_tokenizing(tmp_path, tiny_tokenizer, texts, monkeypatch):
    corpus = make_corpus(tmp_path, texts)
    train, val = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    expected = [item(*train[i]) for i in range(len(train))]

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(workers, "encode_chunk", refuse)
    again, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    assert [item(*again[i]) for i in range(len(again))] == expected
    # the key ignores the sequence settings: other windows come from the same arrays
    packed, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=5, packing="pack")
    assert len(packed) > 0
    names = sorted(p.name for p in cache_folder(tmp_path).iterdir())  # no temporary, no lock
    assert names == ["train-00000.bin", "train-00000.idx", "train.json"] + [
        "validation-00000.bin", "validation-00000.idx", "validation.json"
    ]  # fmt: skip


def test_cache_is_rebuilt_for_another_tokenizer(tmp_path, tiny_tokenizer, texts, monkeypatch):
    corpus = make_corpus(tmp_path, texts)
    build(tmp_path, corpus, tiny_tokenizer)
    other = train_tokenizer(texts, vocab_size=300)
    calls = []
    real = workers.encode_chunk
    monkeypatch.setattr(workers, "encode_chunk", lambda *a: calls.append(1) or real(*a))
    train, _ = build(tmp_path, corpus, other, seq_length=16)
    assert calls
    assert item(*train[0])[:3] == framed(other, list(corpus.train)[0])[:3]
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2


def test_followers_wait_for_the_process_that_leads(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    waits = []
    lead, follow = (Preparation(leads, lambda: waits.append(1)) for leads in (True, False))
    roles = special_ids(tiny_tokenizer)
    with pytest.raises(UserError, match="missing after the main process built it"):
        token_caches([corpus], tiny_tokenizer, tmp_path / "cache", roles, prep=follow)
    assert not list((tmp_path / "cache").glob("tokens-*"))  # a follower builds nothing
    token_caches([corpus], tiny_tokenizer, tmp_path / "cache", roles, prep=lead)
    ((train, _),), _ = token_caches(
        [corpus], tiny_tokenizer, tmp_path / "cache", roles, prep=follow
    )
    assert waits == [1, 1, 1] and train.complete and train.total["tokens"] > 0


def test_patience_reports_a_long_wait_and_gives_up_at_its_limit():
    said = []
    patience = Patience(said.append, report=60, limit=1620, timeout=1800, who="rank 3")
    reports = 0
    for seconds in (0.5, 59, 61, 100, 125, 1619):
        reports = patience.waited(seconds, "train shard 12 of token cache /c/tokens-x", reports)
    assert said == [
        "waiting 61 s for train shard 12 of token cache /c/tokens-x (the token cache is still "
        "being built)",
        "waiting 125 s for train shard 12 of token cache /c/tokens-x (the token cache is still "
        "being built)",
        "waiting 1619 s for train shard 12 of token cache /c/tokens-x (the token cache is still "
        "being built)",  # one report a look, however late
    ]
    with pytest.raises(DataWaitTimeout) as error:
        patience.waited(1621, "train shard 12 of token cache /c/tokens-x", reports)
    assert str(error.value).startswith(
        "rank 3 waited 1621 s for train shard 12 of token cache /c/tokens-x, which its machine "
        "is still building, while its peers wait in a collective that gives up after 1800 s "
        "(build the whole cache first"
    )
    assert Patience(said.append, report=60).waited(10**6, "x", 99) == 100  # no limit: it waits


def test_the_limit_is_for_jobs_across_machines():
    """On one machine every rank waits for the same shard: nothing to give up on."""
    one = D.Runtime("ddp", torch.device("cpu"), rank=1, world_size=4, multiprocess=True)
    two = D.Runtime("ddp", torch.device("cpu"), rank=1, world_size=4, multiprocess=True, machines=2)
    assert waiting_patience(one).limit is None and waiting_patience(one).report == 60
    assert waiting_patience(two).limit == 1680 and waiting_patience(two).who == "rank 1"
    assert waiting_patience(D.Runtime("single", torch.device("cpu"))).limit is None


def _starve(rank: int, port: int, out: str) -> None:
    """One rank of a 2-machine gloo job (one process per machine) whose collectives give up
    after 6 s: rank 0 has its data and waits in the step's collective; rank 1's next shard is
    slow (built after 30 s), so it waits for it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LLAMA_DDP_COLLECTIVE_TIMEOUT="0.1",
    )  # fmt: skip
    rt = runtime("ddp", "cpu")
    result = {"machines": rt.machines, "timeout": rt.timeout.total_seconds()}
    D.preparation_barrier(rt)
    start = time.perf_counter()
    try:
        if rank == 0:
            D.barrier(rt)  # the all-reduce of the step, on the training group
        else:
            said = []
            split = ShardedSplit(Path(out) / "cache", "train", np.uint16)
            split.patience = replace(waiting_patience(rt), say=said.append)
            result["said"] = said
            split.wait_for_shard(0)
        result["outcome"] = "returned"
    except (DataWaitTimeout, RuntimeError) as exc:
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    result["after_s"] = time.perf_counter() - start
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_a_rank_starved_of_a_slow_shard_says_so_before_its_peer_times_out(tmp_path):
    """gloo on the CPU: rank 1 gives up on its slow shard half-way through the 6 s timeout,
    with one line naming the rank, the shard and the remedies, before rank 0's collective times
    out."""
    (tmp_path / "cache").mkdir()
    start_ranks(_starve, (free_port(), str(tmp_path)))
    waiting, starved = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert starved["machines"] == 2 and starved["timeout"] == 6
    assert re.fullmatch(
        f"DataWaitTimeout: rank 1 waited 3 s for train shard 0 of token cache {tmp_path}/cache,"
        " which its machine is still building, while its peers wait in a collective that gives "
        r"up after 6 s \(build the whole cache first: .*\)",
        starved["outcome"],
    ), starved["outcome"]
    assert 3 <= starved["after_s"] < 4
    assert len(starved["said"]) == 3  # at 0.75, 1.5 and 2.25 s
    for text in starved["said"]:
        assert re.fullmatch(
            f"waiting [1-3] s for train shard 0 of token cache {tmp_path}/cache "
            r"\(the token cache is still being built\)",
            text,
        ), text
    assert waiting["outcome"].startswith("RuntimeError")  # its peer is gone: it stops too
