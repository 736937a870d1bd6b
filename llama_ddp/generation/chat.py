"""Chat templates: the one a model's tokenizer carries (tokenizer_config.json's ``chat_template`` or
a ``chat_template.jinja`` beside it), rendered as transformers' ``apply_chat_template`` renders it
(a sandboxed Jinja environment, blocks trimmed, the tokenizer's special tokens as variables), for
``generate --chat`` and ``--chat-template`` (llama_ddp/generate.py reads the turns).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer

from llama_ddp.data.tokenizer_files import SpecialTokens
from llama_ddp.errors import UserError

_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


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


def end_of_turn(
    tokenizer: Tokenizer, special: SpecialTokens, config: dict[str, Any] | None
) -> set[int]:
    """The ids that end a reply: EOT, and the EOS of the tokenizer_config.json ``config`` (a chat
    model's end of turn)."""
    stop = {special.ids.eot}
    eos = tokenizer.token_to_id(special_token_names(config).get("eos_token", special.eot))
    if eos is not None:
        stop.add(eos)
    return stop
