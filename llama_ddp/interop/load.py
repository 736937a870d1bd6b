"""One loader for every command that reads a model (``--init-from``, generate, evaluate, export):
a run folder, a checkpoint folder (``checkpoints/step-N``), a ``llama_model.pth`` with its
``llama_model.json`` (or a folder holding one), a Hugging Face Llama folder (or a file of one), a
GGUF file, or a hub repository id.

A run folder gives its final ``llama_model.pth``, or while it has none (a run still going, or
stopped), its newest intact checkpoint. A checkpoint's weights are read through checkpoint/state.py,
its shape from the settings it records, and its tokenizer must be the one it was trained with.

Every load goes through ``torch.load(weights_only=True)``, safetensors, DCP or GGUF: a file holding
anything but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import find_resume
from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import (
    TOKENIZER_FILE,
    SpecialIds,
    locate_tokenizer,
    read_tokenizer,
)
from llama_ddp.errors import UserError
from llama_ddp.files import hub
from llama_ddp.files.gguf import is_gguf, read_gguf_config, read_gguf_weights
from llama_ddp.interop.hf import from_hf_state_dict, hf_llama_config, is_hf_folder, read_hf
from llama_ddp.interop.native import MODEL_FILE, read_model
from llama_ddp.model.config import LlamaConfig, naming
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.weights import load_weights


def model_path(name: str | Path, what: str = "model") -> tuple[Path, Path | None]:
    """Where the model ``name`` names is on disk, and the checkpoint folder it is when it is one
    (a checkpoint folder, or a run folder that has no ``llama_model.pth`` yet: its newest).
    ``what`` names the flag in errors."""
    path = hub.local_path(name, hub.MODEL_FILES, what)
    if is_checkpoint(path):
        return path, path
    if path.is_dir() and not is_hf_folder(path) and not (path / MODEL_FILE).is_file():
        checkpoint = find_resume(path, "auto")
        if checkpoint is None:
            raise UserError(
                f"{path} holds no model: no {MODEL_FILE}, config.json or intact checkpoint "
                "(give a run folder, a model file or folder, a .gguf file, or a checkpoint)"
            )
        note = f"{path} has no {MODEL_FILE} yet: reading its checkpoint {checkpoint.name}"
        print(note, file=sys.stderr)
        return checkpoint, checkpoint
    return path, None


def model_folder(path: Path, checkpoint: Path | None) -> Path:
    """The folder whose tokenizer.json is the model's: a checkpoint's run folder, a model
    folder, or the folder of a model file."""
    if checkpoint is not None:
        return checkpoint.parent.parent  # OUT/checkpoints/step-N -> OUT
    return path if path.is_dir() else path.parent


def read_source(
    name: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A model's shape and weights, from anything the module's docstring names: a
    ``llama_model.pth`` reads its ``llama_model.json`` unless ``config_path`` says otherwise, a
    GGUF is dequantized to fp32. A tied source's state names both the embedding and the lm_head."""
    path, checkpoint = model_path(name)
    if checkpoint is not None:
        model = load_checkpoint_model(checkpoint)
        config, state = model.config, dict(model.state_dict())
    elif is_gguf(path):
        config, state = read_gguf(path)
    else:
        if path.is_file() and path.suffix in (".json", ".safetensors"):
            path = path.parent  # a file of a model folder (config.json, model.safetensors, ...)
        config, state = read_hf(path) if is_hf_folder(path) else read_model(path, config_path)
    check_finite(state, checkpoint or path)
    return config, state


def check_finite(state: dict[str, torch.Tensor], source: Path) -> None:
    """A UserError naming the first weight of ``state`` that holds a NaN or an infinity: such a
    model computes nothing (NaN logits), whatever the data or the learning rate."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(
                f"model {source}: its weights are not finite ({name} holds {bad:,} NaN or "
                f"infinite values of {tensor.numel():,}) (use an earlier checkpoint or another "
                "model: these weights compute no number)"
            )


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A GGUF file's shape (refused unless it is a plain Llama, before any tensor is read) and its
    weights, dequantized to fp32 by transformers' loader."""
    config = hf_llama_config(read_gguf_config(path), path)
    state = from_hf_state_dict(read_gguf_weights(path))
    return config, {k: v for k, v in state.items() if "rotary_emb" not in k}


def load_model(
    path: str | Path,
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """Load a model for inference from anything ``read_source`` reads: a ``llama_model.pth`` (its
    ``llama_model.json`` is found beside it unless ``config_path`` says otherwise), a folder
    holding one, a Hugging Face Llama folder (config.json + model.safetensors, or its shards) or a
    file of one, or a GGUF file."""
    source = f"model {path}" + (f" with config {config_path}" if config_path else "")
    config, state = read_source(path, config_path)
    if torch.device(device).type != "cpu":  # the host's RAM was checked with the config
        config.check_fits(device)
    model = LlamaForPretraining(config)
    load_weights(model, state, source)
    return model.to(device).eval()


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ckpt.STATE).is_file() and (path / ".metadata").is_file()


def load_checkpoint_model(path: Path) -> LlamaForPretraining:
    """The weights of the checkpoint folder ``path`` in a plain model of its recorded shape."""
    problem = ckpt.verify_checkpoint(path)
    if problem:
        raise UserError(f"checkpoint {path} is not usable: {problem} (use another checkpoint)")
    with naming(path / ckpt.STATE):
        config = LlamaConfig.from_dict(ckpt.saved_setting(path, "model_shape"))
    model = LlamaForPretraining(config)
    ckpt.load_checkpoint(path, {"model": ckpt.ModelState(model)})
    return model


def load_for_evaluation(
    name: str, tokenizer_name: str | None, device: torch.device
) -> tuple[LlamaForPretraining, Tokenizer, SpecialIds]:
    """The model ``name`` names (anything `read_source` reads) in eval mode on ``device``, and its
    tokenizer: ``tokenizer_name``, else the one saved beside the model (for a checkpoint: in its
    run folder)."""
    path, checkpoint = model_path(name, "--model")
    model = load_model(path, device=device)
    beside = model_folder(path, checkpoint)
    where = tokenizer_name and locate_tokenizer(tokenizer_name)
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
