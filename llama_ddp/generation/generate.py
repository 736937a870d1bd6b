"""Inference: sampling, and generation with a KV cache (the generate command is
llama_ddp/generate.py).

Generation feeds the prompt once into a preallocated KVCache (prefill), then one token per step.
Every forward goes through ``model(input_ids, cache)``; ``use_cache=False`` passes no cache and
recomputes the whole prefix each step, the reference the cached path is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer_files import SpecialIds, special_ids
from llama_ddp.errors import UserError
from llama_ddp.model.llama import KVCache, LlamaForPretraining


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError unless temperature >= 0, top_k >= 1 and 0 < top_p <= 1."""
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature {temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top-k {top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top-p {top_p} must be in (0, 1]")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (..., V) -> (...,).

    Temperature 0 is greedy (argmax; top-k/top-p change nothing then). Otherwise the logits are
    divided by the temperature, cut to the ``top_k`` most likely tokens (ties with the k-th are
    kept) and to the smallest set whose probability reaches ``top_p``, then sampled. Logits that
    are not finite (a model whose outputs overflow) are a UserError: no token is made up.
    """
    if not bool(torch.isfinite(logits).all()):
        raise UserError(
            "the model's logits are not finite (NaN or infinite): it gives no distribution to "
            "sample from (try --dtype fp32, or another checkpoint)"
        )
    if temperature == 0:
        return logits.argmax(dim=-1)  # no softmax: it cannot change the argmax
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens before it already reach top_p: the most likely token is
        # always kept, and the kept set is the smallest whose mass reaches top_p.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = logits.softmax(dim=-1).reshape(-1, vocab)
    return torch.multinomial(probs, 1, generator=generator).view(logits.shape[:-1])


def room_for(context: int, prompt_length: int) -> int:
    """How many tokens can follow a prompt: the last one is sampled from the logits of position
    ``context - 1`` and never fed back, hence the + 1."""
    return context - prompt_length + 1


def generate(
    model: LlamaForPretraining,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot_id: int | Collection[int] | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Yield new token ids after the prompt ``input_ids`` (1-D, or shape (1, T)), one at a time.

    Stops after ``max_new_tokens``, after yielding ``eot_id`` (or any of several), or when the
    model's context is full (see ``room_for``), whichever comes first. Arguments are checked now,
    not at the first ``next()``.
    """
    check_sampling(temperature, top_k, top_p)
    stop = {eot_id} if isinstance(eot_id, int) else set(eot_id or ())
    param = next(model.parameters())
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=param.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be one non-empty sequence, got shape {tuple(ids.shape)}")
    p, context = ids.numel(), model.config.max_position_embeddings
    if p > context:
        raise ValueError(f"prompt of {p} tokens exceeds the context of {context}")
    steps = min(max_new_tokens, room_for(context, p))
    with torch.inference_mode():
        seq = torch.empty(1, p + max(steps, 0), dtype=torch.long, device=ids.device)
        seq[0, :p] = ids
        cache = None
        if use_cache and steps > 0:
            cache = KVCache(model.config, 1, p + steps - 1, device=ids.device, dtype=param.dtype)

    def tokens() -> Iterator[int]:
        # inference_mode is entered per step, never across a yield: the caller's code between two
        # tokens must not run with autograd switched off behind its back.
        fed = 0
        for end in range(p, p + steps):
            with torch.inference_mode():
                # With a cache, feed only what it lacks: the prompt (prefill), then one token.
                logits = model(seq[:, fed:end], cache, last_only=True)[:, -1]  # (1, V)
                seq[0, end] = sample_next(logits, temperature, top_k, top_p, generator)[0]
            fed = end if cache is not None else 0
            token = int(seq[0, end].item())  # the one host sync per token: to stream and to stop
            yield token
            if token in stop:
                return

    return tokens()


def generate_text(
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    seed: int | None = None,
    special: SpecialIds | None = None,
    **kwargs: Any,
) -> str:
    """``prompt`` followed by the model's continuation, as the CLI prints it; the continuation
    alone is ``result[len(prompt):]``. Greedy unless ``temperature`` is given.

    ``tokenizer`` is a ``tokenizers.Tokenizer``; ``special`` its roles (``read_tokenizer(path)``
    gives both; default: our [BOT]/[EOT]). The prompt is prefixed with BOT as every training
    sequence is (special tokens typed in it are parsed), and EOT ends the text without appearing
    in it. ``kwargs`` go to ``generate``
    (temperature, top_k, top_p, use_cache).
    """
    special = special or special_ids(tokenizer)
    ids = prompt_ids(tokenizer, special, prompt)
    generator = None
    if seed is not None:
        generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    new = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        eot_id=special.eot,
        generator=generator,
        **kwargs,
    )
    return prompt + tokenizer.decode(list(new))


def prompt_ids(tokenizer: Tokenizer, special: SpecialIds, prompt: str) -> list[int]:
    """BOT + the prompt's tokens, as every training sequence starts. A special token typed in the
    prompt (``<|im_start|>``) is that token, as the tokenizer itself encodes it."""
    return [special.bot, *tokenizer.encode(prompt, add_special_tokens=False).ids]
