"""The tokenizer's files and roles: where a ``--tokenizer`` is (a file, a folder, a hub id, a GGUF
file), reading and writing tokenizer.json and tokenizer_config.json, which tokens play our roles,
and a tokenizer folder's chat template.

The roles BOT, EOT and PAD are our tokens ``[BOT]``, ``[EOT]``, ``[PAD]``, unless a
``tokenizer_config.json`` lies beside the ``tokenizer.json`` (a Hugging Face tokenizer folder, as
``save_pretrained`` writes it, or a run's folder): then they are the roles it records
(``llama_ddp_roles``, which a run writes), else its ``bos_token``, ``eos_token`` and ``pad_token``
(the EOS when it has none: padding targets are masked by position, so any id serves). Flags
(``--bot-token`` ...) override any of them, by name or id.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llama_ddp.errors import UserError
from llama_ddp.files import hub, safe_io
from llama_ddp.files.gguf import is_gguf, write_tokenizer_folder
from llama_ddp.files.preparation import ALONE, Preparation

SPECIAL_TOKENS = ("[BOT]", "[EOT]", "[PAD]")  # our roles' tokens, at ids 0, 1, 2 when we train
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
ROLES_KEY = "llama_ddp_roles"  # in a run's tokenizer_config.json: which tokens play BOT/EOT/PAD
ROLES = ("bot", "eot", "pad")
# What a tokenizer folder holds beside tokenizer.json and tokenizer_config.json that a run keeps
# as it is: the special tokens, the chat template, the generation defaults.
TEMPLATE_FILE = "chat_template.jinja"  # a chat template beside its tokenizer.json
SIDE_FILES = ("special_tokens_map.json", TEMPLATE_FILE, "generation_config.json")


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


def locate_tokenizer(
    spec: str | Path, cache_dir: Path | None = None, prep: Preparation = ALONE
) -> Path:
    """The tokenizer.json a ``--tokenizer`` names, for every command: the file, the one in a
    folder, a hub repository id's, or a GGUF file's tokenizer made into a folder in ``cache_dir``
    (default: the corpus cache; made as ``prep`` says)."""
    path = hub.local_path(spec, hub.TOKENIZER_FILES, "--tokenizer")
    if is_gguf(path):
        from llama_ddp.data.corpus import cache_folder  # pyarrow: only where it is needed

        path = _gguf_tokenizer(path, cache_folder(cache_dir), prep)
    return tokenizer_file(path)


def _gguf_tokenizer(path: Path, cache_dir: Path, prep: Preparation) -> Path:
    """The tokenizer folder made of a GGUF file's tokenizer, cached by the file's path, size and
    modification time (made as ``prep`` says)."""
    stat = path.stat()
    name = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    folder = cache_dir / f"gguf-tokenizer-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    if prep.leads and not (folder / TOKENIZER_FILE).is_file():
        print(f"reading the tokenizer of {path} -> {folder}", file=sys.stderr, flush=True)
        with safe_io.writing(folder, "tokenizer"):
            write_tokenizer_folder(path, folder, "--tokenizer")
    prep.wait()
    return folder


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write ``tok`` as one tokenizer.json; a crash mid-write never leaves a truncated file."""
    path = Path(path)
    with safe_io.writing(path, "tokenizer"):
        path.parent.mkdir(parents=True, exist_ok=True)
        safe_io.write_text(path, tok.to_str(pretty=True))


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` names: itself, or the one in the folder it names."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json (or a folder holding one) and check that its roles resolve."""
    return read_tokenizer(path)[0]


def read_tokenizer(
    path: str | Path, roles: dict[str, str | None] | None = None
) -> tuple[Tokenizer, SpecialTokens]:
    """The tokenizer.json at ``path`` (or in the folder ``path``) and its roles, taken from the
    tokenizer_config.json beside it if there is one; ``roles`` overrides them (``special_tokens``).
    """
    path = tokenizer_file(path)
    if not path.is_file():
        fix = "train one with `python tokenizer/train_tokenizer.py` or pass the right path"
        raise safe_io.not_a_file(path, "tokenizer file", fix)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise UserError(
            f"{path} is not a readable tokenizer.json: {e} (retrain or re-export it)"
        ) from e
    config = source_config(path)
    source = path.with_name(TOKENIZER_CONFIG) if config is not None else path
    return tok, special_tokens(tok, config, source=source, roles=roles)


def source_config(path: Path) -> dict[str, Any] | None:
    """The tokenizer_config.json beside the tokenizer.json ``path``, if there is one."""
    config_path = path.with_name(TOKENIZER_CONFIG)
    if not config_path.is_file():
        return None
    return safe_io.read_json(config_path, "tokenizer config")


def special_tokens(
    tok: Tokenizer,
    config: dict[str, Any] | None = None,
    *,
    source: str | Path = "the tokenizer",
    roles: dict[str, str | None] | None = None,
) -> SpecialTokens:
    """Our roles in ``tok``: ``roles`` (``{"bot": name or id, ...}``, from ``--bot-token`` ...)
    first, then the roles a tokenizer_config.json records (a run's), else its bos/eos/pad tokens
    (BOT and PAD: the EOT when it names none), else ``[BOT]``, ``[EOT]``, ``[PAD]``. Each must be
    one of ``tok``'s special tokens, which text never encodes to (``text_encoder``): only the
    framing code places them."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    given = {
        role: _role_token(tok, special, role, value)
        for role, value in (roles or {}).items()
        if value is not None
    }
    if config is None:
        names = [given.get(role, default) for role, default in zip(ROLES, SPECIAL_TOKENS)]
        for name in names:
            if name not in special:
                raise UserError(
                    f"{source} lacks the special token {name} (train a tokenizer with "
                    f"`python tokenizer/train_tokenizer.py`, add {', '.join(SPECIAL_TOKENS)} as "
                    "special tokens, give a folder with its tokenizer_config.json, or name its "
                    "tokens with --bot-token, --eot-token, --pad-token)"
                )
    else:
        names = _config_roles(config, special, given, source)
    return SpecialTokens(*names, SpecialIds(*(special[name] for name in names)))


def _config_roles(
    config: dict[str, Any], special: dict[str, int], given: dict[str, str], source: str | Path
) -> list[str]:
    """The roles a tokenizer_config.json gives (see ``special_tokens``), ``given`` ones first."""
    recorded = config.get(ROLES_KEY)
    if isinstance(recorded, dict):
        keys = {role: f"{ROLES_KEY}.{role}" for role in ROLES}
        named = {role: _token_name(recorded, role, keys[role]) for role in ROLES}
    else:
        keys = dict(zip(ROLES, ("bos_token", "eos_token", "pad_token")))
        named = {role: _token_name(config, key) for role, key in keys.items()}
    named.update(given)
    for role, name in named.items():
        if name is not None and name not in special:
            raise UserError(
                f"{source}: its {keys[role]} {name!r} is not a special token of the "
                "tokenizer.json beside it (fix tokenizer_config.json, or use the matching "
                "tokenizer.json)"
            )
    eot = named["eot"]
    if eot is None:
        raise UserError(
            f"{source} names no eos_token (add it, or name one with --eot-token: documents need "
            "an end-of-text token)"
        )
    # No BOS (GPT-2 and Qwen style): the end-of-text token also opens each document.
    return [named["bot"] or eot, eot, named["pad"] or eot]


def _role_token(tok: Tokenizer, special: dict[str, int], role: str, value: str) -> str:
    """The special token ``--{role}-token`` names, by name or by id."""
    name = tok.id_to_token(int(value)) if value.isdigit() else value
    if name not in special:
        known = ", ".join(sorted(special, key=special.get)[:12])
        raise UserError(
            f"--{role}-token {value!r} is not a special token of the tokenizer (give the name "
            f"or id of one of its special tokens: {known})"
        )
    return name


def _token_name(config: dict[str, Any], key: str, label: str | None = None) -> str | None:
    """A tokenizer_config.json entry: a string, ``{"content": ...}`` (an AddedToken), or null."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise UserError(
            f"tokenizer_config.json's {label or key} {value!r} is not a token (give a string)"
        )
    return value


def special_ids(tok: Tokenizer, *, source: str | Path = "the tokenizer") -> SpecialIds:
    """Ids of ``[BOT]``, ``[EOT]``, ``[PAD]`` (our own tokenizers' roles); a UserError if one is
    missing or not special."""
    return special_tokens(tok, source=source).ids


def tokenizer_config(
    special: SpecialTokens, source: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The tokenizer_config.json written beside a run's tokenizer.json (and in its hf/ export):
    the source's own (``source``: its chat template, unk and other special tokens,
    ``add_bos_token``, as they are) or, for our tokenizers, the roles under transformers' names;
    either way the roles under ``llama_ddp_roles``, which ``read_tokenizer`` reads first."""
    if source is None:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1_000_000,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,  # framing is ours: nothing is added when encoding
            "bos_token": special.bot,
            "eos_token": special.eot,
            "pad_token": special.pad,
        }
    else:
        config = dict(source)
    return {**config, ROLES_KEY: special.names()}


def write_tokenizer_files(
    tokenizer_path: str | Path, special: SpecialTokens, out_dir: Path
) -> dict[str, Any]:
    """Into ``out_dir``: the tokenizer.json at ``tokenizer_path`` (or in that folder), its
    tokenizer_config.json with the roles (``tokenizer_config``) and the SIDE_FILES beside it, each
    replaced atomically. Returns the config written."""
    path = tokenizer_file(tokenizer_path)
    config = tokenizer_config(special, source_config(path))
    same = path.parent.resolve() == out_dir.resolve()
    if not same:
        safe_io.copy_file(path, out_dir / TOKENIZER_FILE)
        for name in SIDE_FILES:
            if path.with_name(name).is_file():
                safe_io.copy_file(path.with_name(name), out_dir / name)
    safe_io.write_text(out_dir / TOKENIZER_CONFIG, json.dumps(config, indent=2) + "\n")
    return config


def find_template(
    tokenizer_path: Path, config: dict[str, Any] | None, file: Path | None = None
) -> str:
    """The chat template: ``file`` if given, else the tokenizer's (``config`` is the
    tokenizer_config.json beside the tokenizer.json at ``tokenizer_path``)."""
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"chat template {file} is not readable text ({exc})") from exc
    template = (config or {}).get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    if tokenizer_path.with_name(TEMPLATE_FILE).is_file():
        return tokenizer_path.with_name(TEMPLATE_FILE).read_text(encoding="utf-8")
    raise UserError(
        f"the tokenizer {tokenizer_path} has no chat template (give one: --chat-template FILE)"
    )
