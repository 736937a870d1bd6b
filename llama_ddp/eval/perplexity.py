"""Perplexity and bits per byte of a text stream, or of documents, under a model (``generate
--perplexity``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.eval.windows import window_batch, windows
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


def bits_per_byte(nll_sum: float, num_bytes: int) -> float:
    """The summed next-token loss ``nll_sum`` (nats) in bits per UTF-8 byte of the text scored:
    comparable across tokenizers, as a perplexity is not."""
    return nll_sum / math.log(2) / num_bytes


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


def documents_nll(
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    special: SpecialIds,
    docs: Sequence[str],
    seq_length: int | None = None,
    batch_size: int = 8,
) -> tuple[float, int]:
    """(summed next-token NLL, predicted tokens) of ``docs``: each framed as in training, [BOT]
    doc [EOT], and scored alone, as training with documents kept apart (the default) computes
    its validation loss."""
    encoded = text_encoder(tokenizer).encode_batch(list(docs), add_special_tokens=False)
    total, count = 0.0, 0
    for enc in encoded:
        loss, n = nll(model, [special.bot, *enc.ids, special.eot], seq_length, batch_size)
        total, count = total + loss, count + n
    return total, count
