"""data/tokenizer.py: training (the special tokens at ids 0-2), encoding, fingerprints, the
tokenizer/train_tokenizer.py script."""

import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models

from llama_ddp.data.tokenizer import token_bytes, tokenizer_fingerprint, train_tokenizer
from llama_ddp.data.tokenizer_files import (
    SPECIAL_TOKENS,
    SpecialIds,
    load_tokenizer,
    save_tokenizer,
    special_ids,
)
from llama_ddp.errors import UserError
from tests.helpers.runs import ROOT


def test_special_tokens_present_distinct_and_single_ids(tiny_tokenizer):
    ids = special_ids(tiny_tokenizer)
    assert ids == SpecialIds(bot=0, eot=1, pad=2)
    for name, i in zip(SPECIAL_TOKENS, (ids.bot, ids.eot, ids.pad)):
        assert tiny_tokenizer.encode(name).ids == [i]
        assert tiny_tokenizer.id_to_token(i) == name


def test_encoding_adds_no_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello").ids
    assert not set(ids) & {0, 1, 2}


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn  x ** 2\n\n",
        "  leading and trailing spaces  ",
        "unseen bytes: ∮ E⋅da = Q, 漢字, 🦙🦙, \x00\x7f",
        "",
    ],
)
def test_decode_inverts_encode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text).ids) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("a é€😀", 11), ("def f(x):\n    return x\n", 23)],  # a, space 1 each, é 2, € 3, 😀 4
)
def test_token_bytes_sum_to_the_texts_utf8_bytes(tiny_tokenizer, text, expected):
    """Bits per byte's denominator: the bytes of a text's tokens add up to its UTF-8 bytes (a
    character split over tokens counts once), and the special tokens count none."""
    lengths = token_bytes(tiny_tokenizer)
    ids = tiny_tokenizer.encode(text).ids
    assert lengths[ids].sum() == len(text.encode("utf-8")) == expected
    specials = [tiny_tokenizer.token_to_id(t) for t in ("[BOT]", "[EOT]", "[PAD]")]
    assert lengths[specials].tolist() == [0, 0, 0]
    assert (lengths[3:] >= 1).all()  # every other token stands for some bytes


def test_token_bytes_of_a_sentencepiece_style_vocabulary():
    """``▁`` is one space and ``<0xNN>`` one byte; an added special token none."""
    tok = Tokenizer(models.WordLevel({"<s>": 0, "▁the": 1, "<0x0A>": 2, "é": 3}, unk_token="<s>"))
    tok.add_special_tokens(["<s>"])
    assert token_bytes(tok).tolist() == [0, 4, 1, 2]


def test_vocab_size_is_honoured(tiny_texts):
    assert train_tokenizer(tiny_texts, vocab_size=300).get_vocab_size() == 300


def test_save_load_roundtrip_keeps_fingerprint(tiny_tokenizer, tmp_path):
    path = tmp_path / "sub" / "tokenizer.json"
    save_tokenizer(tiny_tokenizer, path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left
    loaded = load_tokenizer(path)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tiny_tokenizer)
    assert loaded.encode("def add").ids == tiny_tokenizer.encode("def add").ids


def test_fingerprint_differs_between_tokenizers(tiny_tokenizer):
    other = train_tokenizer(["another corpus entirely"] * 4, vocab_size=300)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_tokenizer)
    assert len(tokenizer_fingerprint(other)) == 64


def test_training_refuses_tiny_vocab_and_empty_input():
    with pytest.raises(UserError, match="too small"):
        train_tokenizer(["text"], vocab_size=100)
    with pytest.raises(UserError, match="no documents"):
        train_tokenizer([], vocab_size=300)


def test_train_tokenizer_script(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"body": f"document {i} says hi"}) + "\n" for i in range(40))
    )
    out = tmp_path / "tok.json"
    cmd = [sys.executable, str(ROOT / "tokenizer" / "train_tokenizer.py"), "--dataset", str(data)]
    cmd += ["--vocab-size", "300", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: {str(data)!r} has no text column 'text'; its columns are body "
        "(pass --text-column with one of them)"
    )
    good = subprocess.run(
        [*cmd, "--text-column", "body", "--max-docs", "10"], capture_output=True, text=True
    )
    assert good.returncode == 0, good.stderr
    assert "on 10 documents" in good.stdout and str(out) in good.stdout
    assert special_ids(load_tokenizer(out)) == SpecialIds(0, 1, 2)
