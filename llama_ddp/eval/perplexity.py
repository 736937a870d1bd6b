"""Perplexity of a text stream under a model, and the ``--perplexity`` of the generate CLI."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.errors import UserError
from llama_ddp.eval.windows import window_batch, windows
from llama_ddp.files import safe_io
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.loss import token_loss_sum


def perplexity(
    model: LlamaForPretraining,
    token_ids: Sequence[int] | torch.Tensor,
    seq_length: int | None = None,
    batch_size: int = 8,
) -> float:
    """exp(mean next-token NLL) of ``token_ids``, each token after the first predicted once."""
    total, count = nll(model, token_ids, seq_length, batch_size)
    return math.exp(total / count)


def nll(
    model: LlamaForPretraining,
    token_ids: Sequence[int] | torch.Tensor,
    seq_length: int | None = None,
    batch_size: int = 8,
) -> tuple[float, int]:
    """(summed next-token NLL, predicted tokens) of one stream, in the windows validation scores
    a document with (`windows.windows`): each token with all of its earlier context up to
    ``seq_length`` (default: the model's context), never a window longer than the text, and only
    real positions computed."""
    context = model.config.max_position_embeddings
    length = seq_length or context
    if not 1 <= length <= context:
        raise ValueError(f"seq_length {length} must be in [1, {context}] (the model's context)")
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size} must be >= 1")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    count = ids.numel() - 1
    if count < 1:
        raise ValueError("perplexity needs at least two tokens")
    spans = np.asarray(windows(ids.numel(), length), dtype=np.int64)
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.inference_mode():
        for start in range(0, len(spans), batch_size):
            rows = spans[start : start + batch_size]
            batch = window_batch(ids, rows, length, multiple=1).to(device)
            logits = model(batch.x, plan=batch.plan, rows=batch.rows)  # scored positions only
            total += token_loss_sum(logits, batch.labels).double()
    return total.item(), count


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The generate CLI's perplexity flags."""
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


def perplexity_cli(
    model: LlamaForPretraining, tokenizer: Tokenizer, special: SpecialIds, args: argparse.Namespace
) -> int:
    path: Path = args.perplexity
    if str(path) == "validation" and not path.exists():
        from llama_ddp.data.corpus import load_splits  # imports `datasets`: only when asked

        docs = list(load_splits("sample").validation)
    elif not path.is_file():
        fix = "check the path; `validation` names the sample corpus's validation split"
        raise safe_io.not_a_file(path, "perplexity file", fix)
    else:
        try:
            docs = [path.read_text(encoding="utf-8")]
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not readable UTF-8 text ({exc})") from exc
    # Each document framed as in training, [BOT] doc [EOT], and scored alone, as training with
    # documents kept apart (the default) computes its validation loss.
    encoded = text_encoder(tokenizer).encode_batch(docs, add_special_tokens=False)
    total, count = 0.0, 0
    for enc in encoded:
        try:
            loss, n = nll(
                model, [special.bot, *enc.ids, special.eot], args.seq_length, args.batch_size
            )
        except ValueError as exc:
            raise UserError(f"{exc} (fix --seq-length / --batch-size)") from exc
        total, count = total + loss, count + n
    if not math.isfinite(total):
        raise UserError(
            f"the model's log-likelihoods of {path} are not finite, so it has no perplexity (try "
            "--dtype fp32, or another checkpoint)"
        )
    mean = total / count
    print(f"perplexity: {math.exp(mean) if mean < 709 else math.inf:.4f} ({count} tokens)")
    return 0
