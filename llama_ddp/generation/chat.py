"""Chat templates: the one a model's tokenizer carries (tokenizer_config.json's ``chat_template`` or
a ``chat_template.jinja`` beside it), rendered as transformers' ``apply_chat_template`` renders it
(a sandboxed Jinja environment, blocks trimmed, the tokenizer's special tokens as variables), for
``generate --chat`` and ``--chat-template``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llama_ddp.data.tokenizer_files import SpecialTokens, find_template, source_config
from llama_ddp.errors import UserError

_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The generate CLI's chat flags."""
    p.add_argument(
        "--chat",
        action="store_true",
        help="a conversation: --prompt (if given), then each line of stdin, is a user turn "
        "answered through the model's chat template (or --chat-template FILE's)",
    )
    p.add_argument(
        "--chat-template",
        nargs="?",
        const=True,
        metavar="FILE",
        help="answer --prompt (or stdin) as one user turn through the model's chat template, "
        "or FILE's (a Jinja template)",
    )


def render(
    template: str,
    messages: list[dict[str, str]],
    config: dict[str, Any] | None,
    add_generation_prompt: bool = True,
) -> str:
    """``messages`` through the template, as ``apply_chat_template(..., tokenize=False)``."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **special_token_names(config),
        )
    except TemplateError as exc:
        raise UserError(f"the chat template fails: {exc} (fix or replace it)") from exc


def special_token_names(config: dict[str, Any] | None) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token of a tokenizer_config.json, as strings."""
    out = {}
    for key in _TOKEN_KEYS:
        value = (config or {}).get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def converse(
    turns: Iterable[str],
    template: str,
    config: dict[str, Any] | None,
    encode: Callable[[str], list[int]],
    respond: Callable[[list[int]], str],
) -> None:
    """A conversation: each of ``turns`` is a user message; the whole conversation so far goes
    through the template and ``encode``, and ``respond`` answers it (the reply joins it)."""
    messages: list[dict[str, str]] = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        reply = respond(encode(render(template, messages, config)))
        messages.append({"role": "assistant", "content": reply})


def chat_cli(
    tokenizer: Tokenizer,
    special: SpecialTokens,
    path: Path,
    args: argparse.Namespace,
    sample: Callable[[list[int], set[int]], list[int]],
) -> int:
    """``generate --chat`` / ``--chat-template``: user turns (``turns``) through the template of
    the tokenizer at ``path`` (or ``--chat-template FILE``), special tokens in it parsed;
    ``sample`` answers each until EOT or the tokenizer's EOS (a chat model's end of turn)."""
    config = source_config(path)
    file = args.chat_template if isinstance(args.chat_template, str) else None
    template = find_template(path, config, Path(file) if file else None)
    stop = {special.ids.eot}
    eos = tokenizer.token_to_id(special_token_names(config).get("eos_token", special.eot))
    if eos is not None:
        stop.add(eos)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def respond(ids: list[int]) -> str:
        return tokenizer.decode([t for t in sample(ids, stop) if t not in stop])

    converse(turns(args), template, config, encode, respond)
    return 0


def turns(args: argparse.Namespace) -> Iterator[str]:
    """The user turns: --prompt, then with --chat each line of stdin; --chat-template alone
    without --prompt reads stdin whole as one turn."""
    if args.prompt is not None:
        yield args.prompt
    elif not args.chat:
        yield sys.stdin.read().removesuffix("\n")
    while args.chat:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.removesuffix("\n")
