"""``python -m llama_ddp.generate`` (``llama-ddp-generate``): text from a trained model, a chat
through its template, or the perplexity of a file; the flags, the printing and the exit codes
over generation/ (sampling), eval/perplexity.py and interop/load.py (any model)::

    python -m llama_ddp.generate --model out/small/llama_model.pth --prompt "def main"
    python -m llama_ddp.generate --model out/small/hf --perplexity some_file.py
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer_files import (
    SpecialIds,
    SpecialTokens,
    find_template,
    locate_tokenizer,
    read_tokenizer,
    source_config,
)
from llama_ddp.distributed.runtime import resolve_device
from llama_ddp.errors import ArgumentParser, UserError, exit_command, run_command
from llama_ddp.eval.perplexity import bits_per_byte, documents_nll
from llama_ddp.files import safe_io
from llama_ddp.files.gguf import is_gguf
from llama_ddp.generation import chat
from llama_ddp.generation.generate import check_sampling, generate, prompt_ids, room_for
from llama_ddp.interop.hf import is_hf_folder
from llama_ddp.interop.load import locate, model_folder, open_model
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.precision import DTYPES, emulation_warning, resolve_dtype


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
    p.add_argument(
        "--perplexity",
        type=Path,
        metavar="FILE",
        help="print the perplexity of FILE (one document), or of the sample corpus's "
        "validation split with `validation`, instead of generating",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        help="perplexity window: each token is scored with its earlier context up to this "
        "(default: the model's context; never longer than the text)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="perplexity windows per forward")
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
    docs = None if args.perplexity is None else _perplexity_docs(args.perplexity)
    path, through_checkpoint = locate(args.model, "--model")
    if (through_checkpoint or is_hf_folder(path) or is_gguf(path)) and args.config is not None:
        raise UserError(
            "--config applies to llama_model.pth, not to a Hugging Face model, a GGUF file or "
            "a checkpoint (drop it)"
        )
    model, source = open_model(path, "--model", config_path=args.config, device=device)
    dtype = resolve_dtype(args.dtype, device)
    model.to(dtype)
    warning = emulation_warning(dtype, device)
    if warning:
        print(warning, file=sys.stderr)
    own = path if is_gguf(path) else model_folder(source.path, source.checkpoint)  # its own
    tokenizer_path = locate_tokenizer(args.tokenizer if args.tokenizer is not None else own)
    roles = {"bot": args.bot_token, "eot": args.eot_token}
    tokenizer, special = read_tokenizer(tokenizer_path, roles)
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, the model only "
            f"{model.config.vocab_size} (use the tokenizer.json saved with the model)"
        )
    if args.perplexity is not None:
        return _perplexity(model, tokenizer, special.ids, docs, args)
    if args.chat or args.chat_template:

        def sample(ids: list[int], stop: set[int]) -> list[int]:
            return _sample(model, tokenizer, ids, stop, args)

        return _chat(tokenizer, special, tokenizer_path, args, sample)
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


def _chat(
    tokenizer: Tokenizer,
    special: SpecialTokens,
    path: Path,
    args: argparse.Namespace,
    sample: Callable[[list[int], set[int]], list[int]],
) -> int:
    """``--chat`` / ``--chat-template``: user turns (``_turns``) through the template of the
    tokenizer at ``path`` (or ``--chat-template FILE``), special tokens in it parsed; ``sample``
    answers each until EOT or the tokenizer's EOS (a chat model's end of turn)."""
    config = source_config(path)
    file = args.chat_template if isinstance(args.chat_template, str) else None
    template = find_template(path, config, Path(file) if file else None)
    stop = chat.end_of_turn(tokenizer, special, config)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def respond(ids: list[int]) -> str:
        return tokenizer.decode([t for t in sample(ids, stop) if t not in stop])

    chat.converse(_turns(args), template, config, encode, respond)
    return 0


def _turns(args: argparse.Namespace) -> Iterator[str]:
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


def _perplexity_docs(path: Path) -> list[str]:
    """The documents ``--perplexity`` scores, read before the model: the file's text, or the
    sample corpus's validation split; a UserError when there is nothing to score."""
    if str(path) == "validation" and not path.exists():
        from llama_ddp.data.corpus import load_splits  # imports `datasets`: only when asked

        return list(load_splits("sample").validation)
    if not path.is_file():
        fix = "check the path; `validation` names the sample corpus's validation split"
        raise safe_io.not_a_file(path, "perplexity file", fix)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not readable UTF-8 text ({exc})") from exc
    if not text:
        raise UserError(
            f"perplexity file {path} is empty: there is nothing to score (give a file with text)"
        )
    return [text]


def _perplexity(
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    special: SpecialIds,
    docs: list[str],
    args: argparse.Namespace,
) -> int:
    """``--perplexity FILE``: the documents' perplexity (``documents_nll``) and bits per byte
    (over the documents' UTF-8 bytes), one line."""
    path: Path = args.perplexity
    try:
        total, count = documents_nll(
            model, tokenizer, special, docs, args.seq_length, args.batch_size
        )
    except ValueError as exc:
        raise UserError(f"{exc} (fix --seq-length / --batch-size)") from exc
    if not math.isfinite(total):
        raise UserError(
            f"the model's log-likelihoods of {path} are not finite, so it has no perplexity (try "
            "--dtype fp32, or another checkpoint)"
        )
    mean, num_bytes = total / count, sum(len(doc.encode("utf-8")) for doc in docs)
    bpb = f", bits per byte {bits_per_byte(total, num_bytes):.4f}" if num_bytes else ""
    perplexity = math.exp(mean) if mean < 709 else math.inf
    print(f"perplexity: {perplexity:.4f} ({count} tokens, {num_bytes} bytes){bpb}")
    return 0


if __name__ == "__main__":
    exit_command(main())
