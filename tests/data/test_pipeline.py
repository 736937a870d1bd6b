"""data/pipeline.py: the run's data settings refused in one line before any tokenization."""

import pytest

from llama_ddp.errors import UserError
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
