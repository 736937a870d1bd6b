"""The trained model's files: ``llama_model.pth`` (the plain state dict), ``llama_model.json`` (its
LlamaConfig), ``tokenizer.json`` and ``tokenizer_config.json`` (its roles), and loading a model
back for inference.

Every load goes through ``torch.load(weights_only=True)`` or safetensors: a file holding anything
but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llama_ddp import files
from llama_ddp.config import LlamaConfig
from llama_ddp.errors import UserError
from llama_ddp.model import LlamaForPretraining
from llama_ddp.tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    read_tokenizer,
    tokenizer_config,
    tokenizer_file,
)

MODEL_FILE = "llama_model.pth"
CONFIG_FILE = "llama_model.json"


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the prefixes DataParallel/DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.replace(prefix, "")
        out[name] = tensor
    return out


def save_model(
    model: torch.nn.Module | dict[str, torch.Tensor],
    config: LlamaConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
) -> Path:
    """Write ``llama_model.pth`` (the plain state dict of ``model``, or ``model`` itself when it is
    a state dict), ``llama_model.json`` and, given a tokenizer (a tokenizer.json or its folder),
    ``tokenizer.json`` with its roles in ``tokenizer_config.json`` into ``out_dir``; each file is
    replaced atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = model if isinstance(model, dict) else model.state_dict()
    state = {k: v.detach().cpu() for k, v in clean_state_dict(state).items()}
    files.torch_save(state, out_dir / MODEL_FILE)
    files.atomic_write(out_dir / CONFIG_FILE, config.save)
    if tokenizer_path is not None:
        source = tokenizer_file(tokenizer_path)
        _, special = read_tokenizer(source)
        if source.resolve() != (out_dir / TOKENIZER_FILE).resolve():
            files.copy_file(source, out_dir / TOKENIZER_FILE)
        text = json.dumps(tokenizer_config(special), indent=2) + "\n"
        files.write_text(out_dir / TOKENIZER_CONFIG, text)
    return out_dir / MODEL_FILE


def load_model(
    path: str | Path,
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """Load a trained model for inference.

    ``path`` is a ``llama_model.pth`` (its ``llama_model.json`` is found beside it unless
    ``config_path`` says otherwise), a folder holding one, or an exported Hugging Face folder
    (config.json + model.safetensors).
    """
    path = Path(path)
    if path.is_dir() and (path / "model.safetensors").is_file():
        from llama_ddp.hf import import_hf

        return import_hf(path).to(device).eval()
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise UserError(f"model {path} not found (train one with train.py, or check the path)")
    config = LlamaConfig.load(config_path or path.with_name(CONFIG_FILE))
    state = files.safe_load(path, "model")
    if not isinstance(state, dict):
        raise UserError(f"model {path} is not a state dict")
    model = LlamaForPretraining(config)
    try:
        model.load_state_dict(clean_state_dict(state), strict=True)
    except RuntimeError as exc:
        raise UserError(
            f"model {path} does not match its config {config_path or path.with_name(CONFIG_FILE)} "
            f"({_first_mismatch(exc)})"
        ) from exc
    return model.to(device).eval()


def _first_mismatch(exc: RuntimeError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]
