"""Any saved model with its tokenizer, for evaluation: a run folder, a ``llama_model.pth``, an
``hf/`` folder (or any Hugging Face Llama folder), a checkpoint folder (``checkpoints/step-N``),
or a hub repository id.

A run folder gives its final ``llama_model.pth``, or while it has none (a run still going, or
stopped), its newest intact checkpoint. A checkpoint's weights are read through checkpoint.py,
its shape from the settings it records, and its tokenizer must be the one it was trained with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from llama_ddp import checkpoint as ckpt
from llama_ddp import hub
from llama_ddp.checkpointer import find_resume
from llama_ddp.errors import UserError
from llama_ddp.hf import is_hf_folder
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import LlamaConfig
from llama_ddp.tokenizer import (
    TOKENIZER_FILE,
    SpecialIds,
    read_tokenizer,
    tokenizer_fingerprint,
)
from llama_ddp.weights import MODEL_FILE, load_model


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ckpt.STATE).is_file() and (path / ".metadata").is_file()


def load_checkpoint_model(path: Path) -> LlamaForPretraining:
    """The weights of the checkpoint folder ``path`` in a plain model of its recorded shape."""
    problem = ckpt.verify_checkpoint(path)
    if problem:
        raise UserError(f"checkpoint {path} is not usable: {problem} (use another checkpoint)")
    model = LlamaForPretraining(LlamaConfig.from_dict(ckpt.saved_setting(path, "model_shape")))
    ckpt.load_checkpoint(path, {"model": ckpt.ModelState(model)})
    return model


def load_for_evaluation(
    name: str, tokenizer_name: str | None, device: torch.device
) -> tuple[LlamaForPretraining, Tokenizer, SpecialIds]:
    """The model ``name`` names (see the module's docstring) in eval mode on ``device``, and its
    tokenizer: ``tokenizer_name``, else the one saved beside the model (for a checkpoint: in its
    run folder)."""
    path = hub.local_path(name, hub.MODEL_FILES, "--model")
    checkpoint = None
    if is_checkpoint(path):
        checkpoint = path
    elif path.is_dir() and not is_hf_folder(path) and not (path / MODEL_FILE).is_file():
        checkpoint = find_resume(path, "auto")
        if checkpoint is None:
            raise UserError(
                f"{path} holds no model: no {MODEL_FILE}, config.json or intact checkpoint "
                "(give a run folder, a model file or folder, or a checkpoint)"
            )
        print(f"{path} has no {MODEL_FILE} yet: evaluating its checkpoint {checkpoint.name}")
    if checkpoint is not None:
        model = load_checkpoint_model(checkpoint)
        beside = checkpoint.parent.parent  # OUT/checkpoints/step-N -> OUT
    else:
        model = load_model(path)
        beside = path if path.is_dir() else path.parent
    where = tokenizer_name and hub.local_path(tokenizer_name, hub.TOKENIZER_FILES, "--tokenizer")
    if where is None and not (beside / TOKENIZER_FILE).is_file():
        raise UserError(
            f"no {TOKENIZER_FILE} beside the model in {beside} (pass --tokenizer: the one the "
            "model was trained with)"
        )
    tokenizer, special = read_tokenizer(where or beside)
    if checkpoint is not None and tokenizer_fingerprint(tokenizer) != ckpt.saved_setting(
        checkpoint, "tokenizer"
    ):
        raise UserError(
            f"checkpoint {checkpoint} was trained with another tokenizer than "
            f"{where or beside} (pass --tokenizer: the one the run was trained with)"
        )
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model only "
            f"{model.config.vocab_size} (use the tokenizer saved with the model)"
        )
    return model.to(device).eval(), tokenizer, special.ids
