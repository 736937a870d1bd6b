"""data/pipeline.py: the run's data settings refused in one line before any tokenization; a run
on a complete token cache reads no corpus."""

import json
import shutil
import sys

import pytest
import torch

from llama_ddp.errors import UserError
from tests.helpers.runs import load_weights, tiny_args, train_here
from tests.helpers.token_data import build, make_corpus


def test_user_errors(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    with pytest.raises(ValueError, match="packing must be"):  # users' flags: DataSettings
        build(tmp_path, corpus, tiny_tokenizer, packing="stuff")
    with pytest.raises(UserError, match="fewer than one sequence of 4097"):
        build(tmp_path, corpus, tiny_tokenizer, seq_length=4096, packing="pack")
    with pytest.raises(UserError, match="no non-empty documents"):
        build(
            tmp_path, make_corpus(tmp_path / "e", ["", "", "x"], val_fraction=0.5), tiny_tokenizer
        )


@pytest.mark.e2e
def test_a_run_on_a_complete_cache_never_imports_datasets(train_env, tmp_path, monkeypatch):
    """The first run on a corpus reads it through `datasets`, builds its token cache and notes
    its fingerprint; the same run again, with `datasets` unimportable, trains on the cache alone
    to the same weights and losses, bit for bit. Once the file changes, a resume is refused as
    it always was: a different corpus."""
    corpus, cache = tmp_path / "docs.jsonl", tmp_path / "cache"
    shutil.copy(train_env["corpus"], corpus)

    def train(out: str, *extra: str):
        args = tiny_args(train_env, tmp_path / out, "--dataset", str(corpus), *extra)
        return train_here(train_env, [*args, "--cache-dir", str(cache)])

    assert train("read").returncode == 0
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # what train.py sets, undone
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    cached = train("cached")
    assert cached.returncode == 0, cached.stderr[-3000:]
    ours, expected = load_weights(tmp_path / "cached"), load_weights(tmp_path / "read")
    assert all(torch.equal(ours[k], expected[k]) for k in expected)
    losses = [
        [r.get("loss") for r in map(json.loads, (tmp_path / out / "metrics.jsonl").open())]
        for out in ("read", "cached")
    ]
    assert losses[0] == losses[1] and len([x for x in losses[0] if x is not None]) == 8
    monkeypatch.undo()
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    refused = train("cached", "--max-steps", "10")
    assert refused.returncode == 2
    assert "it was trained with a different corpus (" in refused.stderr
