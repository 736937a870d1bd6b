"""Export to and import from the Hugging Face Llama format (config.json + model.safetensors, or
its shards).

Our weight names are Hugging Face's with ``base_model.`` for ``model.``, and RoPE uses the same
rotate-half convention, so the conversion is a renaming: no permutation, no arithmetic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors.torch import save_file

from llama_ddp.data.tokenizer_files import SpecialIds, read_tokenizer, write_tokenizer_files
from llama_ddp.errors import UserError
from llama_ddp.files import safe_io
from llama_ddp.model.config import LlamaConfig, naming
from llama_ddp.model.llama import LlamaForPretraining

CONFIG_JSON = "config.json"
GENERATION_CONFIG, SPECIAL_TOKENS_MAP = "generation_config.json", "special_tokens_map.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_OURS, _THEIRS = "base_model.", "model."
_ROPE_BUFFERS = ("base_model.rotary_emb.cos", "base_model.rotary_emb.sin")
_EMBEDDING, _HEAD = "base_model.embed_tokens.weight", "lm_head.weight"


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], tied: bool = False
) -> dict[str, torch.Tensor]:
    """Hugging Face's names; a tied model's lm_head is not stored (it is the embedding)."""
    out = {}
    for name, tensor in state_dict.items():
        if name in _ROPE_BUFFERS or (tied and name == _HEAD):
            continue  # recomputed from rope_theta by every loader; tied to embed_tokens
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
        "tie_word_embeddings": config.tie_word_embeddings,
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
    """Write ``out_dir`` with config.json, model.safetensors (one embedding matrix when tied) and,
    given a tokenizer.json (or its folder), the tokenizer files: its tokenizer_config.json with
    the roles (the source's chat template, unk token, add_bos_token kept), its chat template,
    special tokens map and generation config; ``transformers.AutoModelForCausalLM`` and
    ``AutoTokenizer`` load it. ``model`` is a model, or its state dict with its ``config``."""
    if isinstance(model, dict):
        state = model
        assert config is not None, "a state dict needs its config"
    else:
        state, config = model.state_dict(), model.config
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tensors = to_hf_state_dict(state, tied=config.tie_word_embeddings)
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    with safe_io.writing(out_dir, "Hugging Face export", needed):
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            special = None
            if tokenizer_path is not None:
                special = _write_tokenizer_files(Path(tokenizer_path), tmp)
            text = json.dumps(hf_config(config, special), indent=2)
            (tmp / CONFIG_JSON).write_text(text + "\n")
            if not (tmp / GENERATION_CONFIG).is_file():  # the source's is kept as it is
                generation = _token_ids(special)
                (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
            save_file(tensors, tmp / SAFETENSORS, {"format": "pt"})
            safe_io.usual_mode(tmp / SAFETENSORS)
            safe_io.replace_dir(tmp, out_dir)  # the previous export goes only once this is whole
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_tokenizer_files(tokenizer_path: Path, out_dir: Path) -> SpecialIds:
    """The tokenizer's files (``tokenizer_files.write_tokenizer_files``), and a
    special_tokens_map.json of its tokens if the source has none."""
    _, special = read_tokenizer(tokenizer_path)
    config = write_tokenizer_files(tokenizer_path, special, out_dir)
    if not (out_dir / SPECIAL_TOKENS_MAP).is_file():
        keys = ("bos_token", "eos_token", "unk_token", "pad_token")
        tokens = {k: config[k] for k in keys if config.get(k) is not None}
        (out_dir / SPECIAL_TOKENS_MAP).write_text(json.dumps(tokens, indent=2) + "\n")
    return special.ids


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_JSON).is_file()


def hf_llama_config(data: dict[str, Any], source: str | Path = CONFIG_JSON) -> LlamaConfig:
    """Our LlamaConfig of a Hugging Face Llama ``config.json`` (transformers' v4 keys, rope_theta
    and rope_scaling, or v5's rope_parameters), with transformers' defaults for absent keys.
    What our model would compute differently is refused, never loaded wrongly: another
    model_type, RoPE scaling, partial rotary embeddings, biases, another activation or head size."""

    def refuse(what: str) -> NoReturn:
        raise UserError(
            f"{source}: {what} is not supported (llama_ddp computes the plain Llama "
            "architecture only: choose a model without it)"
        )

    if data.get("model_type") != "llama":
        refuse(f"model_type {data.get('model_type')!r} (only 'llama')")
    rope = data.get("rope_parameters") or {}
    for params in (rope, data.get("rope_scaling") or {}):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            refuse(f"RoPE scaling {kind!r}")
    if data.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor {data['partial_rotary_factor']}")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            refuse(f"{key} true")
    if data.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {data['hidden_act']!r}")
    shape = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [key for key in shape if key not in data]
    if missing:
        raise UserError(f"{source} lacks {', '.join(missing)} (is it a model's config.json?)")
    with naming(source):
        config = LlamaConfig(
            **{key: data[key] for key in shape},
            num_key_value_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
    if data.get("head_dim", config.head_dim) != config.head_dim:
        refuse(f"head_dim {data['head_dim']} (not hidden_size / num_attention_heads)")
    return config


def read_hf(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The shape and weights (our names) of a Hugging Face Llama folder: config.json and
    model.safetensors, or the shards its model.safetensors.index.json lists. A tied model stores
    its embedding once: the state names it as the lm_head too."""
    folder = Path(folder)
    config_path = folder / CONFIG_JSON
    if not config_path.is_file():
        raise UserError(f"{config_path} not found (give a Hugging Face Llama folder)")
    data = safe_io.read_json(config_path, "model config")
    config = hf_llama_config(data, config_path)
    state = from_hf_state_dict(_read_safetensors(folder))
    # Older transformers saved the rotary frequencies; they are recomputed from rope_theta.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and _EMBEDDING in state:
        state[_HEAD] = state[_EMBEDDING]  # transformers' lm_head is the embedding
    return config, state


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = safe_io.read_json(index, "safetensors index").get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise UserError(
                    f"{index} names the shard {shard!r}, not a file of its folder (re-download it)"
                )
            state.update(safe_io.read_safetensors(folder / shard))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise UserError(f"{index} lists {missing[0]}, which its shards lack (re-download it)")
        return state
    if (folder / SAFETENSORS).is_file():
        return safe_io.read_safetensors(folder / SAFETENSORS)
    raise UserError(
        f"{folder} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX} (llama_ddp reads "
        "safetensors weights: convert the model with transformers' save_pretrained, or give "
        "its .gguf file)"
    )
