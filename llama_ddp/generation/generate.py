"""Inference: sampling, generation with a KV cache, perplexity, and the ``llama-ddp-generate`` CLI.

Generation feeds the prompt once into a preallocated KVCache (prefill), then one token per step.
Every forward goes through ``model(input_ids, cache)``; ``use_cache=False`` passes no cache and
recomputes the whole prefix each step, the reference the cached path is tested against.

    python -m llama_ddp.generate --model out/small/llama_model.pth --prompt "def main"
    python -m llama_ddp.generate --model out/small/hf --perplexity some_file.py
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer_files import SpecialIds, locate_tokenizer, read_tokenizer, special_ids
from llama_ddp.distributed.runtime import resolve_device
from llama_ddp.errors import ArgumentParser, UserError, run_command
from llama_ddp.eval import perplexity
from llama_ddp.files.gguf import is_gguf
from llama_ddp.generation import chat
from llama_ddp.interop.hf import is_hf_folder
from llama_ddp.interop.load import load_model, model_folder, model_path
from llama_ddp.model.llama import KVCache, LlamaForPretraining
from llama_ddp.precision import DTYPES, emulation_warning, resolve_dtype


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


class _Stream:
    """Incremental detokenization: decode all generated ids, hand out the new suffix.

    Byte-level BPE splits a multi-byte character across tokens; until its last byte arrives the
    decoded text ends in U+FFFD, so that tail is held back rather than printed broken.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown :], len(text)
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[self.shown :], len(text)
        return new


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="llama-ddp-generate",
        description="Generate text with a trained llama_ddp model, or measure its perplexity.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="llama_model.pth, a folder holding one, a Hugging Face Llama folder (e.g. OUT/hf), "
        "a hub repository id, or a .gguf file",
    )
    p.add_argument("--config", type=Path, help="llama_model.json (default: beside --model)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json, its folder, or a .gguf file (default: --model's)",
    )
    p.add_argument(
        "--prompt",
        help="text to continue (default: read stdin, one trailing newline "
        "dropped); an empty prompt samples from BOT alone",
    )
    chat.add_arguments(p)
    for role, default in (("bot", "BOS"), ("eot", "EOS")):
        p.add_argument(
            f"--{role}-token",
            help=f"the special token (name or id) playing {role.upper()} (default: the run's, "
            f"else the {default})",
        )
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the most likely tokens up to mass p")
    p.add_argument("--seed", type=int, help="makes sampling reproducible (default: random)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="weights and compute dtype; auto: bf16 on CUDA, fp32 on every CPU (train.py's "
        "auto also takes bf16 on CPUs that multiply it natively)",
    )
    p.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    perplexity.add_arguments(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda args: _run(build_parser().parse_args(args)), argv)


def _run(args: argparse.Namespace) -> int:
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise UserError(f"{exc} (fix the flag)") from exc
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be >= 0")
    device = resolve_device(args.device)
    path, checkpoint = model_path(args.model, "--model")
    if (checkpoint or is_hf_folder(path) or is_gguf(path)) and args.config is not None:
        raise UserError(
            "--config applies to llama_model.pth, not to a Hugging Face model, a GGUF file or "
            "a checkpoint (drop it)"
        )
    model = load_model(path, config_path=args.config, device=device)
    dtype = resolve_dtype(args.dtype, device)
    model.to(dtype)
    warning = emulation_warning(dtype, device)
    if warning:
        print(warning, file=sys.stderr)
    own = path if is_gguf(path) else model_folder(path, checkpoint)  # the model's own tokenizer
    tokenizer_path = locate_tokenizer(args.tokenizer if args.tokenizer is not None else own)
    roles = {"bot": args.bot_token, "eot": args.eot_token}
    tokenizer, special = read_tokenizer(tokenizer_path, roles)
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, the model only "
            f"{model.config.vocab_size} (use the tokenizer.json saved with the model)"
        )
    if args.perplexity is not None:
        return perplexity.perplexity_cli(model, tokenizer, special.ids, args)
    if args.chat or args.chat_template:

        def sample(ids: list[int], stop: set[int]) -> list[int]:
            return _sample(model, tokenizer, ids, stop, args)

        return chat.chat_cli(tokenizer, special, tokenizer_path, args, sample)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read().removesuffix("\n")
    _sample(
        model,
        tokenizer,
        prompt_ids(tokenizer, special.ids, prompt),
        {special.ids.eot},
        args,
        prompt,
    )
    return 0


def _sample(
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    ids: list[int],
    stop: set[int],
    args: argparse.Namespace,
    echo: str = "",
) -> list[int]:
    """Generate after ``ids`` as the flags say, until one of ``stop``; print ``echo`` (the prompt)
    and the new text as it comes, and return the new ids."""
    context = model.config.max_position_embeddings
    if len(ids) > context:
        raise UserError(
            f"prompt is {len(ids)} tokens with BOT, longer than the model's context of "
            f"{context} (shorten the prompt)"
        )
    generator = torch.Generator(next(model.parameters()).device)
    if args.seed is None:
        generator.seed()  # torch's default seed is fixed: without this every run would repeat
    else:
        generator.manual_seed(args.seed)
    tokens = generate(
        model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eot_id=stop,
        generator=generator,
    )
    new: list[int] = []
    if args.no_stream:
        new.extend(tokens)
        print(echo + tokenizer.decode(new))
    else:
        stream = _Stream(tokenizer)
        print(echo, end="", flush=True)
        for token in tokens:
            new.append(token)
            print(stream.push(token), end="", flush=True)
        print(stream.flush())
    room = room_for(context, len(ids))
    if not stop & set(new) and len(new) == room < args.max_new_tokens:
        print(
            f"note: stopped at the model's context limit of {context} tokens "
            f"(the prompt took {len(ids)}; {room} new tokens fit)",
            file=sys.stderr,
        )
    return new
