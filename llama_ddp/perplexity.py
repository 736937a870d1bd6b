"""Perplexity of a text stream under a model, and the ``--perplexity`` of the generate CLI."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from llama_ddp.errors import UserError
from llama_ddp.loss import IGNORE_INDEX
from llama_ddp.model import LlamaForPretraining
from llama_ddp.tokenizer import SpecialIds, text_encoder


def perplexity(
    model: LlamaForPretraining,
    token_ids: Sequence[int] | torch.Tensor,
    seq_length: int | None = None,
    batch_size: int = 8,
) -> float:
    """exp(mean next-token NLL) of ``token_ids``, each token after the first predicted once.

    The stream is cut into windows of ``seq_length`` inputs (default: the model's context) that
    overlap by one token, as pack-mode training does; the last window is right-padded and its
    padding ignored (causal attention keeps the real tokens exact). Windows are independent, so a
    token at a window start sees no earlier context.
    """
    total, count = nll(model, token_ids, seq_length, batch_size)
    return math.exp(total / count)


def nll(
    model: LlamaForPretraining,
    token_ids: Sequence[int] | torch.Tensor,
    seq_length: int | None = None,
    batch_size: int = 8,
) -> tuple[float, int]:
    """(summed next-token NLL, predicted tokens) of one stream, windowed as `perplexity` says."""
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
    windows = -(-count // length)
    pad = windows * length - count
    inputs = F.pad(ids[:-1], (0, pad), value=0).view(windows, length)
    targets = F.pad(ids[1:], (0, pad), value=IGNORE_INDEX).view(windows, length)
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.inference_mode():
        for start in range(0, windows, batch_size):
            x = inputs[start : start + batch_size].to(device)
            y = targets[start : start + batch_size].to(device)
            logits = model(x).float()  # fp32 log-softmax even for a bf16 model
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            total += loss.double()
    return total.item(), count


def perplexity_cli(
    model: LlamaForPretraining, tokenizer: Tokenizer, special: SpecialIds, args: argparse.Namespace
) -> int:
    path: Path = args.perplexity
    if str(path) == "validation" and not path.exists():
        from llama_ddp.corpus import load_splits  # imports `datasets`: only when asked

        docs = list(load_splits("sample").validation)
    elif not path.is_file():
        raise UserError(
            f"perplexity file {path} not found (check the path; `validation` names the sample "
            "corpus's validation split)"
        )
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
    print(f"perplexity: {math.exp(total / count):.4f} ({count} tokens)")
    return 0
