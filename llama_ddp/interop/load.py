"""One loader for every command that reads a model (``--init-from``, generate, evaluate, export):
a run folder, a checkpoint folder (``checkpoints/step-N``), a ``llama_model.pth`` with its
``llama_model.json`` (or a folder holding one), a Hugging Face Llama folder (or a file of one), a
GGUF file, or a hub repository id.

A run folder gives its final ``llama_model.pth``, or while it has none (a run still going, or
stopped), its newest checkpoint complete when it looks: one that the training run prunes while
it is read is skipped for the next newest complete one. A checkpoint's weights are read through
checkpoint/state.py, its shape from the settings it records, and its tokenizer must be the one it
was trained with.

Every load goes through ``torch.load(weights_only=True)``, safetensors, DCP or GGUF: a file holding
anything but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import newest_complete
from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import (
    TOKENIZER_FILE,
    SpecialIds,
    locate_tokenizer,
    read_tokenizer,
)
from llama_ddp.errors import Interrupted, UserError
from llama_ddp.files import hub
from llama_ddp.files.gguf import is_gguf, read_gguf_config, read_gguf_weights
from llama_ddp.interop.hf import from_hf_state_dict, hf_llama_config, is_hf_folder, read_hf
from llama_ddp.interop.native import MODEL_FILE, read_model
from llama_ddp.model.config import LlamaConfig, naming
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.weights import load_weights


def locate(name: str | Path, what: str = "model") -> tuple[Path, bool]:
    """Where the model ``name`` names is on disk (``what`` names the flag in errors), and whether
    it is read through a checkpoint: a checkpoint folder, or a run folder that has no
    ``llama_model.pth`` (yet), read from its newest complete checkpoint when it is loaded."""
    path = hub.local_path(name, hub.MODEL_FILES, what)
    return path, is_checkpoint(path) or _reads_checkpoints(path)


def _reads_checkpoints(path: Path) -> bool:
    """A run folder without its final model: a run still going, or stopped."""
    return path.is_dir() and not is_hf_folder(path) and not (path / MODEL_FILE).is_file()


def model_folder(path: Path, checkpoint: Path | None) -> Path:
    """The folder whose tokenizer.json is the model's: a checkpoint's run folder, a model
    folder, or the folder of a model file."""
    if checkpoint is not None:
        return checkpoint.parent.parent  # OUT/checkpoints/step-N -> OUT
    return path if path.is_dir() else path.parent


@dataclass
class Source:
    """A model as read from disk (`read`): its shape and weights, where they were read, and for a
    checkpoint, which one and the tokenizer it was trained with (its fingerprint)."""

    config: LlamaConfig
    state: dict[str, torch.Tensor]
    path: Path  # the model's file or folder, the GGUF, or the checkpoint folder read
    checkpoint: Path | None = None
    tokenizer: str | None = None


def read(name: str | Path, config_path: str | Path | None = None, what: str = "model") -> Source:
    """The model ``name`` names, from anything the module's docstring names: a ``llama_model.pth``
    reads its ``llama_model.json`` unless ``config_path`` says otherwise, a GGUF is dequantized to
    fp32. A tied source's state names both the embedding and the lm_head."""
    path, through_checkpoint = locate(name, what)
    if is_checkpoint(path):
        source = read_checkpoint(path)
    elif through_checkpoint:
        source = read_newest_checkpoint(path)
    elif is_gguf(path):
        source = Source(*read_gguf(path), path)
    else:
        if path.is_file() and path.suffix in (".json", ".safetensors"):
            path = path.parent  # a file of a model folder (config.json, model.safetensors, ...)
        plain = read_hf(path) if is_hf_folder(path) else read_model(path, config_path)
        source = Source(*plain, path)
    check_finite(source.state, source.path)
    return source


def read_source(
    name: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A model's shape and weights (`read`)."""
    source = read(name, config_path)
    return source.config, source.state


_READS = 10  # tries at a run folder whose checkpoints are pruned while they are read


def read_newest_checkpoint(run: Path) -> Source:
    """The newest checkpoint of the run folder ``run`` that is complete when it looks
    (`newest_complete`), read whole. The run may still be training: a checkpoint it prunes (or
    replaces) while it is read is no longer complete afterwards, and the next newest complete one
    is read instead; a failure of a checkpoint still complete is its own, and raised."""
    for _ in range(_READS):
        checkpoint = newest_complete(run)
        if checkpoint is None:
            raise UserError(
                f"{run} holds no model: no {MODEL_FILE}, config.json or intact checkpoint "
                "(give a run folder, a model file or folder, a .gguf file, or a checkpoint)"
            )
        try:
            source = read_checkpoint(checkpoint, verified=True)
        except (KeyboardInterrupt, SystemExit, Interrupted):
            raise
        except BaseException:  # DCP's CheckpointException is a BaseException
            if ckpt.verify_checkpoint(checkpoint) is None:
                raise
            continue
        note = f"{run} has no {MODEL_FILE} yet: reading its checkpoint {checkpoint.name}"
        print(note, file=sys.stderr)
        return source
    raise UserError(
        f"{run}: its checkpoints were pruned while they were read, {_READS} times (read it "
        "again, or give one checkpoint of a run saved with a larger --keep-last)"
    )


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
    """Load a model for inference from anything `read` reads (`open_model`)."""
    return open_model(path, config_path=config_path, device=device)[0]


def open_model(
    name: str | Path,
    what: str = "model",
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> tuple[LlamaForPretraining, Source]:
    """The model ``name`` names in eval mode on ``device``, and where it was read (its weights
    read once: `Source.state` is empty). A ``llama_model.pth`` finds its ``llama_model.json``
    beside it unless ``config_path`` says otherwise."""
    source = read(name, config_path, what)
    if torch.device(device).type != "cpu":  # the host's RAM was checked with the config
        source.config.check_fits(device)
    model = LlamaForPretraining(source.config)
    label = f"model {name}" + (f" with config {config_path}" if config_path else "")
    load_weights(model, source.state, label)
    source.state = {}
    return model.to(device).eval(), source


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ckpt.STATE).is_file() and (path / ".metadata").is_file()


def read_checkpoint(path: Path, verified: bool = False) -> Source:
    """The weights of the checkpoint folder ``path``, its recorded shape and tokenizer (checked
    complete first unless ``verified``)."""
    problem = None if verified else ckpt.verify_checkpoint(path)
    if problem:
        raise UserError(f"checkpoint {path} is not usable: {problem} (use another checkpoint)")
    settings = ckpt.saved_part(path, "settings") or {}
    with naming(path / ckpt.STATE):
        config = LlamaConfig.from_dict(ckpt.saved_setting(path, "model_shape"))
    model = LlamaForPretraining(config)
    ckpt.load_checkpoint(path, {"model": ckpt.ModelState(model)})
    return Source(config, dict(model.state_dict()), path, path, settings.get("tokenizer"))


def load_for_evaluation(
    name: str, tokenizer_name: str | None, device: torch.device
) -> tuple[LlamaForPretraining, Tokenizer, SpecialIds]:
    """The model ``name`` names (anything `read` reads) in eval mode on ``device``, and its
    tokenizer: ``tokenizer_name``, else the one saved beside the model (for a checkpoint: in its
    run folder)."""
    model, source = open_model(name, "--model", device=device)
    checkpoint = source.checkpoint
    beside = model_folder(source.path, checkpoint)
    where = tokenizer_name and locate_tokenizer(tokenizer_name)
    if where is None and not (beside / TOKENIZER_FILE).is_file():
        raise UserError(
            f"no {TOKENIZER_FILE} beside the model in {beside} (pass --tokenizer: the one the "
            "model was trained with)"
        )
    tokenizer, special = read_tokenizer(where or beside)
    if checkpoint is not None and tokenizer_fingerprint(tokenizer) != source.tokenizer:
        raise UserError(
            f"checkpoint {checkpoint} was trained with another tokenizer than "
            f"{where or beside} (pass --tokenizer: the one the run was trained with)"
        )
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model only "
            f"{model.config.vocab_size} (use the tokenizer saved with the model)"
        )
    return model, tokenizer, special.ids
