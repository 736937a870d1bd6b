"""Train, save and load the byte-level BPE tokenizer, and map our three roles onto its tokens.

The tokenizer is a plain `tokenizers.Tokenizer`: encoding adds no special tokens by itself, the data
layer frames each document as ``[BOT] + tokens + [EOT]`` so that both modes (pad, pack) and
generation decide their framing in one visible place.

The roles BOT, EOT and PAD are our tokens ``[BOT]``, ``[EOT]``, ``[PAD]``, unless a
``tokenizer_config.json`` lies beside the ``tokenizer.json`` (a Hugging Face tokenizer folder, as
``save_pretrained`` writes it, or a run's folder): then they are its ``bos_token``, ``eos_token``
and ``pad_token`` (the EOS when it has none: padding targets are masked by position, so any id
serves).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llama_ddp import files, hub
from llama_ddp.errors import UserError

if TYPE_CHECKING:
    from llama_ddp.corpus import Corpus

SPECIAL_TOKENS = ("[BOT]", "[EOT]", "[PAD]")
AUTO_TRAIN_DOCS = 200_000  # enough text for a BPE vocabulary; bounds time on huge corpora
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the begin-of-text, end-of-text and padding tokens."""

    bot: int
    eot: int
    pad: int


@dataclass(frozen=True)
class SpecialTokens:
    """Which of the tokenizer's tokens play our roles: begin of text, end of text, padding."""

    bot: str
    eot: str
    pad: str
    ids: SpecialIds

    def names(self) -> dict[str, str]:
        return {"bot": self.bot, "eot": self.eot, "pad": self.pad}

    def describe(self) -> str:
        ids = (self.ids.bot, self.ids.eot, self.ids.pad)
        return ", ".join(
            f"{role.upper()} <- {name} ({i})" for (role, name), i in zip(self.names().items(), ids)
        )


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
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[Tokenizer, SpecialTokens, Path]:
    """The tokenizer, its roles and its file: ``spec`` names a tokenizer.json or its folder, or
    is ``auto``: one trained on the corpus the first time and cached by the corpus fingerprint and
    vocabulary size (by the ``is_main`` process, while the others wait at ``barrier``)."""
    if spec != "auto":
        path = tokenizer_file(hub.local_path(spec, hub.TOKENIZER_FILES, "--tokenizer"))
        return (*read_tokenizer(path), path)
    key = hashlib.sha256(f"{corpus.fingerprint}/{vocab_size}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"tokenizer-{key}.json"
    if is_main and not path.is_file():
        print(f"training a {vocab_size}-token tokenizer on the corpus -> {path}", flush=True)
        train_tokenizer_file(corpus.train, vocab_size, path, AUTO_TRAIN_DOCS)
    barrier()
    return (*read_tokenizer(path), path)


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write ``tok`` as one tokenizer.json; a crash mid-write never leaves a truncated file."""
    path = Path(path)
    with files.writing(path, "tokenizer"):
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_text(path, tok.to_str(pretty=True))


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` names: itself, or the one in the folder it names."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json (or a folder holding one) and check that its roles resolve."""
    return read_tokenizer(path)[0]


def read_tokenizer(path: str | Path) -> tuple[Tokenizer, SpecialTokens]:
    """The tokenizer.json at ``path`` (or in the folder ``path``) and its roles, taken from the
    tokenizer_config.json beside it if there is one."""
    path = tokenizer_file(path)
    if not path.is_file():
        raise UserError(
            f"tokenizer file {path} not found "
            "(train one with `python tokenizer/train_tokenizer.py` or pass the right path)"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise UserError(
            f"{path} is not a readable tokenizer.json: {e} (retrain or re-export it)"
        ) from e
    config_path = path.with_name(TOKENIZER_CONFIG)
    if not config_path.is_file():
        return tok, special_tokens(tok, source=path)
    config = files.read_json(config_path, "tokenizer config")
    return tok, special_tokens(tok, config, source=config_path)


def special_tokens(
    tok: Tokenizer, config: dict[str, Any] | None = None, *, source: str | Path = "the tokenizer"
) -> SpecialTokens:
    """Our roles in ``tok``: a tokenizer_config.json's bos/eos/pad tokens (BOT and PAD: the EOS
    when it names none), else ``[BOT]``, ``[EOT]``, ``[PAD]``. Each must be one of ``tok``'s special
    tokens, which text never encodes to (``text_encoder``): only the framing code places them."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    if config is None:
        for name in SPECIAL_TOKENS:
            if name not in special:
                raise UserError(
                    f"{source} lacks the special token {name} (train a tokenizer with "
                    f"`python tokenizer/train_tokenizer.py`, add {', '.join(SPECIAL_TOKENS)} as "
                    "special tokens, or give a folder with its tokenizer_config.json)"
                )
        names = SPECIAL_TOKENS
    else:
        bos, eos, pad = (
            _token_name(config, key) for key in ("bos_token", "eos_token", "pad_token")
        )
        for key, name in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
            if key == "eos_token" and name is None:
                raise UserError(
                    f"{source} names no eos_token (add it: documents need an end-of-text token)"
                )
            if name is not None and name not in special:
                raise UserError(
                    f"{source}: its {key} {name!r} is not a special token of the tokenizer.json "
                    "beside it (fix tokenizer_config.json, or use the matching tokenizer.json)"
                )
        # No BOS (GPT-2 and Qwen style): the end-of-text token also opens each document.
        names = (bos or eos, eos, pad or eos)
    return SpecialTokens(*names, SpecialIds(*(special[name] for name in names)))


def _token_name(config: dict[str, Any], key: str) -> str | None:
    """A tokenizer_config.json entry: a string, ``{"content": ...}`` (an AddedToken), or null."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise UserError(f"tokenizer_config.json's {key} {value!r} is not a token (give a string)")
    return value


def special_ids(tok: Tokenizer, *, source: str | Path = "the tokenizer") -> SpecialIds:
    """Ids of ``[BOT]``, ``[EOT]``, ``[PAD]`` (our own tokenizers' roles); a UserError if one is
    missing or not special."""
    return special_tokens(tok, source=source).ids


def tokenizer_config(special: SpecialTokens) -> dict[str, Any]:
    """The tokenizer_config.json written beside a run's tokenizer.json (and in its hf/ export):
    the roles under transformers' names, so that ``read_tokenizer`` and ``AutoTokenizer`` find
    them. Framing is ours: nothing is added when encoding."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "bos_token": special.bot,
        "eos_token": special.eot,
        "pad_token": special.pad,
    }


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
