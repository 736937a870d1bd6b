"""data/cache/build.py: token shards: layout, workers, locks, resuming, disk errors."""

import json

import numpy as np
import pytest

from llama_ddp.data.cache import build as shards_mod
from llama_ddp.data.cache import workers
from llama_ddp.data.corpus import load_splits
from tests.helpers.token_data import (
    BOT,
    EOT,
    PAD,
    SMALL,
    build,
    cache_folder,
    framed,
    item,
    make_corpus,
)


def test_literal_special_token_text_is_encoded_as_text(tmp_path, tiny_tokenizer):
    corpus = make_corpus(tmp_path, ["see [EOT] and [PAD] here"] * 4, val_fraction=0.3)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=64)
    tokens = item(*train[0])
    assert (
        tokens[0] == BOT
        and tokens.count(EOT) == 1
        and tokens.count(PAD) == 64 + 1 - tokens.index(EOT) - 1
    )


def test_cache_layout_is_shards_of_the_document_stream(
    tmp_path, tiny_tokenizer, texts, monkeypatch
):
    corpus = make_corpus(tmp_path, texts)
    order, real = [], shards_mod.write_shard

    def write_shard(texts, stem, *args):  # which shard, and is validation complete by then
        order.append((stem.name, (stem.parent / "validation.json").exists()))
        real(texts, stem, *args)

    monkeypatch.setattr(shards_mod, "write_shard", write_shard)
    build(tmp_path, corpus, tiny_tokenizer, sharding=SMALL)
    folder, docs = cache_folder(tmp_path), list(corpus.train)
    # The first train shard, then validation (complete at once), then the rest.
    val = sum(name.startswith("validation") for name, _ in order)
    names = ["train-00000", *(f"validation-{k:05d}" for k in range(val)), "train-00001"]
    assert [name for name, _ in order[: val + 2]] == names
    assert [done for _, done in order] == [False] * (val + 1) + [True] * (len(order) - val - 1)
    total = json.loads((folder / "train.json").read_text())
    assert total["dtype"] == "uint16" and total["docs"] == len(docs)
    # Each shard holds the documents after the previous one's until their text reaches its size.
    cut, chars, k = [0], 0, 0
    for i, doc in enumerate(docs):
        chars += len(doc)
        if chars >= SMALL.chars(k) or i == len(docs) - 1:
            cut, chars, k = [*cut, i + 1], 0, k + 1
    assert total["shards"] == k > 3
    for k, (a, b) in enumerate(zip(cut, cut[1:])):
        tokens = np.fromfile(folder / f"train-{k:05d}.bin", dtype=np.uint16)
        offsets = np.fromfile(folder / f"train-{k:05d}.idx", dtype=np.int64)
        lengths = [len(framed(tiny_tokenizer, d)) for d in docs[a:b]]
        assert offsets.tolist() == np.cumsum([0, *lengths]).tolist()
        assert tokens.tolist() == [t for d in docs[a:b] for t in framed(tiny_tokenizer, d)]
    assert total["tokens"] == sum(len(framed(tiny_tokenizer, d)) for d in docs)


def test_worker_processes_build_the_same_cache(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    build(tmp_path / "a", corpus, tiny_tokenizer, sharding=SMALL)
    build(tmp_path / "b", corpus, tiny_tokenizer, sharding=SMALL, num_proc=2)
    a, b = cache_folder(tmp_path / "a"), cache_folder(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert len(names) > 10 and names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_a_full_cache_disk_is_one_line_and_leaves_no_half_built_shard(
    tmp_path, tiny_tokenizer, texts, monkeypatch
):
    import errno

    from llama_ddp.errors import WriteFailed

    corpus = make_corpus(tmp_path, texts)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(workers, "encode_chunk", full)
    with pytest.raises(WriteFailed, match=r"cannot write token cache .*: No space left on device"):
        build(tmp_path, corpus, tiny_tokenizer)
    left = [p.name for p in cache_folder(tmp_path).iterdir()]
    assert left == ["train-00000.lock"]  # no shard, no temporary (an idle lock file is harmless)


def test_a_streamed_dataset_feeds_the_same_sharded_cache(tmp_path, tiny_tokenizer, texts):
    """--streaming (here a save_to_disk folder read as a stream, as a hub dataset would be):
    the builder reads it in order as it arrives and writes the shards of the loaded dataset."""
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts * 5}).save_to_disk(str(folder))
    caches = []
    for streaming in (False, True):
        corpus = load_splits(str(folder), streaming=streaming, cache_dir=tmp_path / "c")
        assert isinstance(corpus.train.dataset, datasets.IterableDataset) == streaming
        build(tmp_path / str(streaming), corpus, tiny_tokenizer, sharding=SMALL, num_proc=2)
        caches.append(cache_folder(tmp_path / str(streaming)))
    names = sorted(p.name for p in caches[0].iterdir())
    assert len(names) > 10 and names == sorted(p.name for p in caches[1].iterdir())
    assert all((caches[0] / n).read_bytes() == (caches[1] / n).read_bytes() for n in names)


def test_each_split_is_read_from_a_copy_of_its_dataset(tmp_path, texts):
    """A source's train and hold-out sides share one `datasets` stream, and the builder reads
    them in two threads at once: one stream read by two threads sometimes yields no rows (a
    source then fails as empty), so each split's reader has a copy of its own."""
    corpus = make_corpus(tmp_path, texts * 5)
    assert corpus.train.dataset is corpus.validation.dataset
    splits = {"train": corpus.train, "validation": corpus.validation}
    jobs = [shards_mod.Job(tmp_path, s, texts, "uint16", SMALL) for s, texts in splits.items()]
    streams = [shards_mod._Stream(job) for job in jobs]
    datasets = {id(corpus.train.dataset), *(id(s.texts.dataset) for s in streams)}
    assert len(datasets) == 3
    assert [list(s.texts) for s in streams] == [list(corpus.train), list(corpus.validation)]


@pytest.mark.parametrize("other_finishes", [True, False])
def test_builders_sharing_a_cache_build_each_shard_once(
    other_finishes, tmp_path, tiny_tokenizer, texts, monkeypatch
):
    """Another builder (another node, another run) holds shard 2's lock: ours skips it, builds
    the rest, waits for the lock, and tokenizes shard 2 only if the other left without it."""
    import fcntl
    import os
    import threading
    import time

    from llama_ddp.data.cache.read import cache_key
    from llama_ddp.data.tokenizer_files import special_ids

    corpus = make_corpus(tmp_path, texts)
    build(tmp_path / "reference", corpus, tiny_tokenizer, sharding=SMALL)
    reference = cache_folder(tmp_path / "reference")
    key = cache_key(corpus, tiny_tokenizer, special_ids(tiny_tokenizer), SMALL)
    folder = tmp_path / "cache" / f"tokens-{key}"
    folder.mkdir(parents=True)
    lock = os.open(folder / "train-00002.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)

    def other_builder():
        time.sleep(1.0)
        if other_finishes:
            for kind in ("bin", "idx"):  # as a builder writes a shard: the .idx last
                (folder / f"train-00002.{kind}").write_bytes(
                    (reference / f"train-00002.{kind}").read_bytes()
                )
        os.close(lock)  # done, or died: the kernel releases the lock either way

    written = []
    real = shards_mod.write_shard
    monkeypatch.setattr(
        shards_mod,
        "write_shard",
        lambda texts, stem, *a: written.append(stem.name) or real(texts, stem, *a),
    )
    other = threading.Thread(target=other_builder)
    other.start()
    build(tmp_path, corpus, tiny_tokenizer, sharding=SMALL)
    other.join()
    assert written.count("train-00002") == (0 if other_finishes else 1)
    assert len(written) == len(set(written))  # no shard twice
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == names  # the lock files are gone
    assert all((folder / n).read_bytes() == (reference / n).read_bytes() for n in names)


def test_an_interrupted_cache_resumes_building_where_it_stopped(
    tmp_path, tiny_tokenizer, texts, monkeypatch
):
    corpus = make_corpus(tmp_path, texts)
    build(tmp_path, corpus, tiny_tokenizer, sharding=SMALL)
    folder = cache_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "train.json").unlink()  # killed after shard 2: its later shards never written
    shards = sorted(folder.glob("train-*.idx"))
    for path in shards[3:]:
        path.unlink()
        path.with_suffix(".bin").unlink()
    (folder / "train-00004.bin.tmp-elsewhere-1").write_bytes(b"half")  # another host's: kept
    written, real = [], shards_mod.write_shard
    monkeypatch.setattr(
        shards_mod,
        "write_shard",
        lambda t, stem, *a: written.append(stem.name) or real(t, stem, *a),
    )
    build(tmp_path, corpus, tiny_tokenizer, sharding=SMALL)
    assert written == [p.stem for p in shards[3:]]  # only what was missing, in order
    assert {p.name: p.read_bytes() for p in folder.iterdir() if "tmp" not in p.name} == before
