"""A state dict and our model: the prefixes wrappers add stripped, weights copied in with every
shape checked, the tied lm_head, and the parameter count of a shape. Reading a state dict from a
file is interop's (interop/load.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llama_ddp.errors import UserError
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.llama import LlamaForPretraining

EMBEDDING, HEAD = "base_model.embed_tokens.weight", "lm_head.weight"


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the prefixes DataParallel/DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.replace(prefix, "")
        out[name] = tensor
    return out


def load_weights(model: LlamaForPretraining, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model``, every weight present and of its shape (a UserError naming
    ``source`` otherwise). Rotary tables a file lacks (a Hugging Face one has none) are the
    model's own: they are constants of its config. A tied model's lm_head is its embedding: a
    state whose two differ is refused (it was trained untied), one without an lm_head gets it."""
    tables = {n: b for n, b in model.named_buffers() if n.startswith("base_model.rotary_emb.")}
    if model.config.tie_word_embeddings and EMBEDDING in state:
        state = {**tied_weights(model.config, state, source), HEAD: state[EMBEDDING]}
    try:
        model.load_state_dict({**tables, **state}, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{source} does not match its config ({_first_mismatch(exc)})") from exc


def tied_weights(
    config: LlamaConfig, weights: Mapping[str, torch.Tensor], source: str
) -> Mapping[str, torch.Tensor]:
    """``weights`` for a model of ``config``: a tied model's lm_head is its embedding, so its
    lm_head entry is dropped, and a state whose lm_head differs from its embedding (trained
    untied) is refused."""
    if not config.tie_word_embeddings or HEAD not in weights:
        return weights
    head, embedding = weights[HEAD], weights.get(EMBEDDING)
    if embedding is not None and head.shape == embedding.shape and not torch.equal(head, embedding):
        raise UserError(
            f"{source} has an lm_head other than its embedding, but its config ties them "
            "(give the config it was trained with)"
        )
    return {name: value for name, value in weights.items() if name != HEAD}


def parameter_count(config: LlamaConfig) -> int:
    """The parameters of a model of this shape (a tied one counts its embedding once), without
    allocating it."""
    return config.num_parameters()


def _first_mismatch(exc: RuntimeError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]
