"""The shape of a Llama model (LlamaConfig, its field names Hugging Face's) and the presets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from llama_ddp.errors import UserError
from llama_ddp.files import safe_io


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model. Field names follow Hugging Face's ``LlamaConfig``."""

    vocab_size: int = 8192
    """Tokens in the vocabulary; always taken from the tokenizer."""
    hidden_size: int = 768
    """Width of the residual stream."""
    intermediate_size: int = 3072
    """Width of the SwiGLU MLP's hidden layer."""
    num_hidden_layers: int = 12
    """Decoder layers."""
    num_attention_heads: int = 12
    """Query heads; must divide hidden_size."""
    num_key_value_heads: int = 3
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    max_position_embeddings: int = 2048
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """The lm_head is the token embedding (one matrix; Hugging Face's name). Written to
    llama_model.json only when true, so an untied model's files are what older versions wrote."""

    def __post_init__(self) -> None:
        if not isinstance(self.tie_word_embeddings, bool):
            raise UserError(
                f"model config tie_word_embeddings={self.tie_word_embeddings!r} is not a boolean "
                "(give true or false)"
            )
        for f in fields(self):
            if f.name == "tie_word_embeddings":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"model config {f.name}={value!r} is not a number (give a number)")
            if not value > 0:
                raise UserError(
                    f"model config {f.name}={value} must be positive (give a value > 0)"
                )
            if f.type == "int" and not float(value).is_integer():
                raise UserError(f"model config {f.name}={value} must be an integer")
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"model config num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size} (choose heads that divide the hidden size)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"model config num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads} "
                "(choose KV heads that divide heads)"
            )
        if self.head_dim % 2:
            raise UserError(
                f"model config head_dim={self.head_dim} (hidden_size / num_attention_heads) "
                "must be even for rotary embeddings (change hidden_size or num_attention_heads)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.tie_word_embeddings:
            del data["tie_word_embeddings"]  # absent is untied: older files and checkpoints agree
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown model config field(s) {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        safe_io.write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LlamaConfig:
        fix = "pass the llama_model.json saved with it"
        return cls.from_dict(safe_io.read_json(path, "model config", fix))


# Presets: `tiny` keeps a CPU training step in tens of milliseconds (tests); `small` pretrains on
# two CPU cores in minutes; `base` is the reference article's configuration.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "base": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=3,
        max_position_embeddings=2048,
    ),
}


def preset(name: str, *, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The named preset with the tokenizer's vocabulary size and any field overridden."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (choose one of: {', '.join(PRESETS)})")
    config = LlamaConfig(vocab_size=vocab_size, **PRESETS[name])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(config, **overrides) if overrides else config
