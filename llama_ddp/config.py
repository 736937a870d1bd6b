"""Configuration dataclasses: the model's shape (LlamaConfig, with presets) and one training run
(TrainConfig). Turning flags and TOML files into a TrainConfig is cli.py's job.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from llama_ddp.errors import UserError


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"model config {f.name}={value!r} is not a number (give a number)")
            if value <= 0:
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
                f"num_attention_heads={self.num_attention_heads} (choose KV heads that divide heads)"
            )
        if self.head_dim % 2:
            raise UserError(
                f"model config head_dim={self.head_dim} (hidden_size / num_attention_heads) must be "
                "even for rotary embeddings (change hidden_size or num_attention_heads)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown model config field(s) {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LlamaConfig:
        path = Path(path)
        if not path.is_file():
            raise UserError(
                f"model config {path} not found (pass the llama_model.json saved with it)"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"model config {path} is not readable JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise UserError(f"model config {path} is not a JSON object")
        return cls.from_dict(data)


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


@dataclass
class TrainConfig:
    """One training run. Every field is a flag of train.py (``--seq-length`` for ``seq_length``)
    and a key of a ``--config`` TOML file; flags override the file."""

    # Model
    preset: str = "small"
    """Model size: tiny, small or base; the fields below override it."""
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None

    # Data
    dataset: str = "sample"
    """`sample` (embedded, offline), a local file/folder/glob, or a hub dataset name."""
    dataset_config: str | None = None
    """Hub dataset configuration, e.g. sample-10BT for HuggingFaceFW/fineweb."""
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False
    """Stream a hub dataset instead of downloading it whole."""
    val_fraction: float = 0.01
    """Held out for validation when the dataset has no validation split."""
    tokenizer: str = "auto"
    """A tokenizer.json, or `auto`: train one on the corpus (cached) the first time."""
    vocab_size: int = 8192
    """Vocabulary of the tokenizer `auto` trains; a given tokenizer decides its own."""
    seq_length: int = 256
    packing: str = "pack"
    """`pack`: documents concatenated into full windows; `pad`: one document per sequence."""
    cache_dir: str | None = None
    """Where tokenized data and the embedded corpus live (default ~/.cache/llama_ddp)."""
    num_workers: int = 0
    """DataLoader worker processes; reading cached tokens is cheap, so 0 is usually fastest."""

    # Optimization
    batch_size: int = 32
    """Global batch in sequences per optimizer step, the same at every world size."""
    micro_batch_size: int | None = None
    """Sequences per process per forward; default: batch_size / world_size (no accumulation)."""
    epochs: int = 1
    max_steps: int | None = None
    """Optimizer steps to run; overrides epochs (the data is cycled as needed)."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int | None = None
    """Default: 100, or a tenth of the run if shorter."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    # Runtime
    mode: str = "auto"
    """auto (DDP under torchrun, else single), single, dp (nn.DataParallel) or ddp."""
    device: str = "auto"
    dtype: str = "auto"
    """fp32, bf16 or fp16 autocast; auto: bf16 on CUDA, fp32 on CPU."""
    compile: bool = False
    seed: int = 1337

    # Output
    out_dir: str = "out"
    save_every: int = 0
    """Checkpoint every N steps; 0: only at the end."""
    keep_last: int = 2
    """Checkpoints kept; older ones are pruned once a newer one is complete."""
    resume: str = "auto"
    """auto (newest complete checkpoint in out_dir, if any), none, or a checkpoint folder."""
    eval_every: int = 0
    """Evaluate every N steps (and always at the end); 0: only at the end."""
    eval_batches: int = 20
    """Validation batches (of micro_batch_size x world_size sequences) per evaluation."""
    log_every: int = 10
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; default: a table of GPUs, or measured on CPU."""
    export_hf: bool = True
    """Also write out_dir/hf/ for transformers."""

    def model_overrides(self) -> dict[str, Any]:
        names = [f.name for f in fields(LlamaConfig) if f.name not in ("vocab_size",)]
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}
