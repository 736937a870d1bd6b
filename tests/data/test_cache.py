"""cache.py: The token cache: keyed by corpus, tokenizer and roles, reused, waited for."""

import pytest

from llama_ddp.data import shards as shards_mod
from llama_ddp.data.cache import token_caches
from llama_ddp.data.pipeline import (
    IGNORE_INDEX,
)
from llama_ddp.data.preparation import Preparation
from llama_ddp.data.tokenizer import SpecialIds, special_ids, train_tokenizer
from llama_ddp.errors import UserError
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

    monkeypatch.setattr(shards_mod, "encode_chunk", refuse)
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
    real = shards_mod.encode_chunk
    monkeypatch.setattr(shards_mod, "encode_chunk", lambda *a: calls.append(1) or real(*a))
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
