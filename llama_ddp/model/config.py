"""The shape of a Llama model (LlamaConfig, its field names Hugging Face's), the presets, and a
run's model settings (ModelSettings: --preset, the shape flags, --init-from)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llama_ddp.errors import UserError
from llama_ddp.files import safe_io
from llama_ddp.model import family
from llama_ddp.settings import Settings, flag_name, setting

if TYPE_CHECKING:  # torch is imported where a device is named: a config alone needs none
    import torch


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
        self.check_fits()

    def num_parameters(self) -> int:
        """The parameters of a model of this shape (a tied one counts its embedding once)."""
        c, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        layer = 2 * c * c + 2 * c * kv + 3 * c * self.intermediate_size + 2 * c
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * c
        return embeddings + self.num_hidden_layers * layer + c

    def weight_bytes(self) -> int:
        """The bytes of a model of this shape in fp32: its parameters and its rotary tables
        (cos and sin, max_position_embeddings x head_dim each)."""
        tables = 2 * self.max_position_embeddings * self.head_dim
        return 4 * (self.num_parameters() + tables)

    def check_fits(self, device: torch.device | str = "cpu", shards: int = 1) -> None:
        """A UserError, before anything is allocated, when this model's fp32 weights (a
        ``shards``-th of them for a sharded model) exceed the memory of ``device``: the host's
        RAM, or a GPU's."""
        what = (
            f"a model of this shape (vocab_size {self.vocab_size}, hidden_size "
            f"{self.hidden_size}, {self.num_hidden_layers} layers, max_position_embeddings "
            f"{self.max_position_embeddings}) needs {{needed}} for its weights alone"
        )
        fix = "choose a smaller shape, or check the model's config"
        check_memory(self.weight_bytes() // shards, device, what, fix)

    def check_batch_fits(
        self, micro_batch: int, seq_length: int, device: torch.device | str, shards: int = 1
    ) -> None:
        """A UserError, before any data is read or any weight made, when training this shape
        cannot fit ``device``: its state alone (the fp32 weights, their gradients and at least
        one optimizer moment: 3 times the weights, a ``shards``-th of them for a sharded
        model) exceeds its memory, or one forward of ``micro_batch`` sequences of
        ``seq_length`` tokens does: the inputs of its layers alone, kept for the backward (2
        bytes a value: bf16, the least any run keeps)."""
        what = (
            f"training a model of this shape ({self.num_hidden_layers} layers, hidden_size "
            f"{self.hidden_size}, vocab_size {self.vocab_size}) needs {{needed}} for its weights, "
            "their gradients and its optimizer's state alone"
        )
        fix = "choose a smaller --model-size or shape, or shard it on more devices: --mode fsdp"
        check_memory(3 * self.weight_bytes() // shards, device, what, fix)
        needed = 2 * micro_batch * seq_length * self.hidden_size * self.num_hidden_layers
        what = (
            f"a micro-batch of {micro_batch:,} sequences of {seq_length} tokens needs at least "
            "{needed} for its layers' inputs alone"
        )
        check_memory(
            needed,
            device,
            what,
            "lower --batch-size, or set --micro-batch-size: gradient accumulation keeps the "
            "global batch",
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
        data = safe_io.read_json(path, "model config", fix)
        with naming(path):
            return cls.from_dict(data)


@contextlib.contextmanager
def naming(source: str | Path) -> Iterator[None]:
    """A config's refusals in this block name the file it was read from."""
    try:
        yield
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from exc


def check_memory(needed: int, device: torch.device | str, what: str, fix: str) -> None:
    """A UserError ``<what>; <device's memory> is N GiB (<fix>)`` when ``needed`` bytes exceed
    the memory of ``device`` (``what`` holds ``{needed}``, filled in GiB)."""
    memory = memory_bytes(device)
    if memory is None or needed <= memory:
        return
    where = "this machine's RAM" if str(device) == "cpu" else f"{device}'s memory"
    said = what.format(needed=f"{needed / 2**30:,.1f} GiB")
    raise UserError(f"{said}; {where} is {memory / 2**30:,.1f} GiB ({fix})")


def memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """The memory of ``device``: a GPU's total, or the host's physical RAM (None where the
    system does not say)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such sysconf name here (not Linux)
        return None


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


def member(depth: int, *, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The model family's member of ``depth`` (model/family.py) with the tokenizer's vocabulary
    size and any field overridden, as `preset` overrides a preset's."""
    config = LlamaConfig(vocab_size=vocab_size, **family.member_shape(depth))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(config, **overrides) if overrides else config


_NOT_SHAPE_FLAGS = ("vocab_size", "tie_word_embeddings")  # the tokenizer decides; --tie-embeddings
PresetName = Literal[tuple(PRESETS)]
AUTO = "auto"  # --model-size auto: chosen from the time budget (train/sizing/)


def is_depth(text: str) -> bool:
    """Whether --model-size ``text`` is written as a depth: ASCII digits only (str.isdigit takes
    '²', which int() refuses, and '٣', which int() reads as 3)."""
    return text.isascii() and text.isdigit()


@dataclass
class ModelSettings(Settings):
    """The model a run trains: a preset and the shape flags over it, or --init-from's source."""

    init_from: str | None = setting(
        None,
        "initial weights of a new run (step 0, fresh optimizer): a llama_model.pth (with its "
        "llama_model.json), a Hugging Face Llama folder or hub repository id (ORG/NAME); the shape "
        "comes from it (--preset does not apply, shape flags must agree); a checkpoint to resume "
        "wins over it",
    )
    preset: PresetName = setting("small", "model size; the shape flags below override it")
    model_size: str | None = setting(
        None,
        "a member of the model family instead of a preset, by its depth: 1, 2, ... (width 64 x "
        "depth, heads of 64, KV heads a quarter, MLP 8/3 of the width; docs/training.md), its "
        "default lr scaled by 256 / width; `auto` (with --time-budget): the size that "
        "should reach the lowest loss in the time, chosen from a few steps of candidates timed "
        "on this machine and run (a resumed run keeps its size)",
    )
    hidden_size: int | None = setting(None, "width of the residual stream (default: the preset's)")
    intermediate_size: int | None = setting(None, "width of the MLP (default: the preset's)")
    num_hidden_layers: int | None = setting(None, "decoder layers (default: the preset's)")
    num_attention_heads: int | None = setting(None, "query heads (default: the preset's)")
    num_key_value_heads: int | None = setting(None, "key/value heads (default: the preset's)")
    max_position_embeddings: int | None = setting(
        None, "longest sequence the model takes (default: the preset's)"
    )
    rope_theta: float | None = setting(None, "RoPE base (default: 10000)")
    tie_embeddings: bool | None = setting(
        None,
        "the lm_head is the token embedding (one matrix); default: untied, or as --init-from's "
        "source is (--no-tie-embeddings unties a tied source: its lm_head starts as a copy)",
    )

    def shape(self, vocab_size: int, source: LlamaConfig | None = None) -> LlamaConfig:
        """The model's shape: the preset, the shape flags and the tokenizer's vocabulary; or
        --init-from's ``source`` (checked against the flags by ``check_source``), whose
        vocabulary must cover every id of the tokenizer's ``vocab_size``."""
        if source is not None:
            if vocab_size > source.vocab_size:
                raise UserError(
                    f"the tokenizer has {vocab_size} tokens, more than the {source.vocab_size} "
                    f"of --init-from {self.init_from} (use the tokenizer the source was trained "
                    "with)"
                )
            return replace(source, tie_word_embeddings=self.tied(source))
        depth = self.depth()
        if depth is not None:
            return member(
                depth, vocab_size=vocab_size, tie_word_embeddings=self.tied(), **self.shape_flags()
            )
        if self.model_size == AUTO:
            raise ValueError("--model-size auto is chosen before the shape is asked for")
        return preset(
            self.preset,
            vocab_size=vocab_size,
            tie_word_embeddings=self.tied(),
            **self.shape_flags(),
        )

    def check(self) -> None:
        if self.model_size is None or self.model_size == AUTO:
            return
        if not is_depth(self.model_size):
            raise UserError(
                f"--model-size {self.model_size!r} is neither auto nor a depth (give a number of "
                f"layers from 1 to {family.MAX_DEPTH}, or auto with --time-budget)"
            )
        family.member_shape(int(self.model_size))

    def depth(self) -> int | None:
        """The family member's depth --model-size names (None: a preset, or auto unchosen)."""
        return int(self.model_size) if self.model_size and is_depth(self.model_size) else None

    def lr_scale(self) -> float:
        """The factor of the optimizer's default peak lr that goes with the model: a family
        member's (`family.lr_scale` of its width), 1 for a preset."""
        depth = self.depth()
        if depth is None:
            return 1.0
        return family.lr_scale(self.hidden_size or family.member_shape(depth)["hidden_size"])

    def check_source(self, source: LlamaConfig) -> None:
        """--init-from's shape against the shape flags given: each must agree with it."""
        clashes = [
            f"--{flag_name(name)} {value} contradicts its {name} {getattr(source, name)}"
            for name, value in self.shape_flags().items()
            if value != getattr(source, name)
        ]
        if self.tie_embeddings and not source.tie_word_embeddings:
            clashes.append(
                "--tie-embeddings would change its logits: its lm_head is not its embedding"
            )
        if clashes:
            raise UserError(
                f"--init-from {self.init_from}: {'; '.join(clashes)} (drop the shape flags: the "
                "shape comes from the source)"
            )

    def tied(self, source: LlamaConfig | None = None) -> bool:
        """Whether the model ties its lm_head to its embedding: --tie-embeddings if given, else
        as the source is (untied from scratch)."""
        if self.tie_embeddings is not None:
            return self.tie_embeddings
        return source is not None and source.tie_word_embeddings

    def shape_flags(self) -> dict[str, Any]:
        """The shape flags given (LlamaConfig's field names)."""
        names = [f.name for f in fields(LlamaConfig) if f.name not in _NOT_SHAPE_FLAGS]
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}
