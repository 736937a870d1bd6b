"""Train the byte-level BPE tokenizer, encode text with it, and resolve a run's ``--tokenizer``
(trained on the corpus for ``auto``). Its files, roles and chat templates are tokenizer_files.py's.

The tokenizer is a plain `tokenizers.Tokenizer`: encoding adds no special tokens by itself, the data
layer frames each document as ``[BOT] + tokens + [EOT]`` so that both modes (pad, pack) and
generation decide their framing in one visible place.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llama_ddp.data.tokenizer_files import (
    SPECIAL_TOKENS,
    SpecialTokens,
    locate_tokenizer,
    read_tokenizer,
    save_tokenizer,
)
from llama_ddp.errors import UserError
from llama_ddp.files.preparation import ALONE, Preparation

if TYPE_CHECKING:
    from llama_ddp.data.corpus import Corpus

AUTO_TRAIN_DOCS = 200_000  # enough text for a BPE vocabulary; bounds time on huge corpora


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` with the special tokens at ids 0, 1, 2.

    Byte level, no normalizer and no prefix space: every string encodes without unknown tokens and
    ``decode(encode(s)) == s`` exactly, which code corpora (whitespace, indentation) need.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UserError(
            f"vocab size {vocab_size} is too small for a byte-level tokenizer "
            f"(use at least {256 + len(SPECIAL_TOKENS)})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # all 256 bytes, so that text unseen in training still encodes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = 0

    def counted() -> Iterator[str]:
        nonlocal seen
        for text in texts:
            seen += 1
            yield text

    tok.train_from_iterator(counted(), trainer)
    if seen == 0:
        raise UserError("no documents to train the tokenizer on (check the dataset and its split)")
    return tok


def train_tokenizer_file(
    texts: Iterable[str], vocab_size: int, path: str | Path, max_docs: int | None = None
) -> tuple[Tokenizer, int]:
    """Train on the first ``max_docs`` of ``texts`` (all by default) and write ``path``: the one
    way both train.py and tokenizer/train_tokenizer.py make a tokenizer. Returns it and the
    number of documents it saw."""
    docs = 0

    def counted() -> Iterator[str]:
        nonlocal docs
        for text in islice(texts, max_docs):
            docs += 1
            yield text

    tok = train_tokenizer(counted(), vocab_size)
    save_tokenizer(tok, path)
    return tok, docs


def resolve_tokenizer(
    spec: str,
    corpus: Corpus,
    vocab_size: int,
    cache_dir: Path,
    *,
    roles: dict[str, str | None] | None = None,
    prep: Preparation = ALONE,
) -> tuple[Tokenizer, SpecialTokens, Path]:
    """The tokenizer, its roles (``roles`` overrides them: see ``special_tokens``) and its file:
    ``spec`` names a tokenizer.json or its folder, a hub repository id, a GGUF file (its tokenizer
    made into a folder in ``cache_dir``), or is ``auto``: one trained on the corpus the first time
    and cached by the corpus fingerprint and vocabulary size (made as ``prep`` says: once per
    machine)."""
    if spec != "auto":
        path = locate_tokenizer(spec, cache_dir, prep)
        return (*read_tokenizer(path, roles), path)
    key = hashlib.sha256(f"{corpus.fingerprint}/{vocab_size}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"tokenizer-{key}.json"
    if prep.leads and not path.is_file():
        print(f"training a {vocab_size}-token tokenizer on the corpus -> {path}", flush=True)
        train_tokenizer_file(corpus.train, vocab_size, path, AUTO_TRAIN_DOCS)
    prep.wait()
    return (*read_tokenizer(path, roles), path)


def text_encoder(tok: Tokenizer | str) -> Tokenizer:
    """A copy of ``tok`` (or of a tokenizer.json string) that encodes "[EOT]" typed in a text as
    text, never as the control token: only the framing code places [BOT]/[EOT], in training data,
    prompts and perplexity streams alike."""
    encoder = Tokenizer.from_str(tok if isinstance(tok, str) else tok.to_str())
    encoder.encode_special_tokens = True
    return encoder


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 of the serialized tokenizer: any change to vocab, merges or settings changes it."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(tok: Tokenizer) -> set[str]:
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    return {d.get("type") for d in decoder.get("decoders", [decoder])}


def token_bytes(tok: Tokenizer) -> np.ndarray:
    """(vocab,) the UTF-8 bytes of the text each token id stands for, bits per byte's
    denominator (validation.py): a byte-level BPE token's bytes (a token may be part of one
    character: its own bytes count); a SentencePiece-style token with its ``▁`` as one space
    and ``<0xNN>`` as one byte; special tokens ([BOT], [EOT], [PAD] and the like) 0 bytes, as
    they stand for no text."""
    byte_level = "ByteLevel" in _decoder_kinds(tok)
    alphabet = _byte_level_chars()
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if piece in special or i >= len(lengths):
            continue
        if byte_level and all(c in alphabet for c in piece):
            lengths[i] = len(piece)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            lengths[i] = 1
        else:
            lengths[i] = len(piece.removeprefix("##").replace("\u2581", " ").encode("utf-8"))
    return lengths
