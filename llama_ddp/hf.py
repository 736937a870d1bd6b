"""Export to and import from the Hugging Face Llama format (config.json + model.safetensors).

Our weight names are Hugging Face's with ``base_model.`` for ``model.``, and RoPE uses the same
rotate-half convention, so the conversion is a renaming: no permutation, no arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llama_ddp.config import LlamaConfig
from llama_ddp.errors import UserError
from llama_ddp.model import LlamaForPretraining
from llama_ddp.tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    SpecialIds,
    read_tokenizer,
    tokenizer_config,
    tokenizer_file,
)

_OURS, _THEIRS = "base_model.", "model."
_ROPE_BUFFERS = ("base_model.rotary_emb.cos", "base_model.rotary_emb.sin")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        if name in _ROPE_BUFFERS:
            continue  # recomputed from rope_theta by every loader
        if name.startswith(_OURS):
            name = _THEIRS + name[len(_OURS) :]
        out[name] = tensor.detach().contiguous().clone()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        (_OURS + k[len(_THEIRS) :] if k.startswith(_THEIRS) else k): v
        for k, v in state_dict.items()
    }


def hf_config(config: LlamaConfig, special: SpecialIds | None = None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        **_token_ids(special),
    }


def _token_ids(special: SpecialIds | None) -> dict[str, int | None]:
    """transformers' names of our roles' ids (None without a tokenizer)."""
    ids = (special.bot, special.eot, special.pad) if special else (None, None, None)
    return dict(zip(("bos_token_id", "eos_token_id", "pad_token_id"), ids))


def export_hf(
    model: LlamaForPretraining | dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    *,
    config: LlamaConfig | None = None,
) -> Path:
    """Write ``out_dir`` with config.json, model.safetensors and, given a tokenizer.json (or its
    folder), the tokenizer files with its roles as bos/eos/pad; ``transformers.AutoModelForCausalLM``/``AutoTokenizer`` load it. ``model``
    is a model, or its state dict with its ``config``."""
    if isinstance(model, dict):
        state = model
        assert config is not None, "a state dict needs its config"
    else:
        state, config = model.state_dict(), model.config
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    special = None
    if tokenizer_path is not None:
        special = _write_tokenizer_files(Path(tokenizer_path), tmp)
    (tmp / "config.json").write_text(json.dumps(hf_config(config, special), indent=2) + "\n")
    generation = _token_ids(special)
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(to_hf_state_dict(state), tmp / "model.safetensors", {"format": "pt"})
    # Replace the previous export only once the new one is complete.
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _write_tokenizer_files(tokenizer_path: Path, out_dir: Path) -> SpecialIds:
    """tokenizer.json, and its roles as tokenizer_config.json and special_tokens_map.json."""
    _, special = read_tokenizer(tokenizer_path)
    shutil.copyfile(tokenizer_file(tokenizer_path), out_dir / TOKENIZER_FILE)
    config = tokenizer_config(special)
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tokens = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")
    return special.ids


def import_hf(folder: str | Path) -> LlamaForPretraining:
    """Load a Hugging Face Llama folder (config.json + model.safetensors) into our class."""
    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserError(f"{path} not found (point to a folder exported by llama_ddp)")
    data = json.loads(config_path.read_text())
    if data.get("model_type") != "llama":
        raise UserError(f"{config_path} is not a Llama model (model_type={data.get('model_type')})")
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    config = LlamaConfig(**{k: v for k, v in data.items() if k in known})
    model = LlamaForPretraining(config)
    state = from_hf_state_dict(load_file(weights_path))
    for name in _ROPE_BUFFERS:
        state[name] = model.state_dict()[name]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"{weights_path} does not match its config.json ({first})") from exc
    return model
