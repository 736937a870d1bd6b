"""Configuration: one training run (TrainConfig), over the model's shape (LlamaConfig and its
presets, model/config.py). Every TrainConfig field carries its help text and, through its type,
its choices: the CLI, TOML files and ``--help`` are derived from the dataclass (cli.py). A choice
(mode, dtype, schedule, preset, logger) is read from the one registry that defines it, never
listed here. Every setting is checked once, in ``TrainConfig.validate``, before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from llama_ddp.data.mixture import micro_batch_size
from llama_ddp.data.pipeline import DataSettings
from llama_ddp.data.sources import Source, resolve_sources
from llama_ddp.distributed.parallelize import MODES
from llama_ddp.errors import UserError
from llama_ddp.eval.tasks import TASKS, TaskSpec, parse_tasks
from llama_ddp.interop.gguf_export import DEFAULT_TYPE, GGUF_TYPES
from llama_ddp.model.config import PRESETS, LlamaConfig, preset
from llama_ddp.precision import DTYPES
from llama_ddp.train.flags import Checked, flag_name
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.optim import OPTIMIZERS, SCHEDULES


def _arg(default: Any, help: str) -> Any:
    """A TrainConfig field: its default and the help text the CLI shows."""
    return field(default=default, metadata={"help": help})


def _choices(registry: dict[str, Any]) -> str:
    """``name: help`` of each entry of a registry, for a flag's help text."""
    return "; ".join(f"{name}: {entry.help}" for name, entry in registry.items())


# Each choice's values come from its registry (a new entry there is a new value here).
PresetName = Literal[tuple(PRESETS)]
ScheduleName = Literal[tuple(SCHEDULES)]
OptimizerName = Literal[tuple(OPTIMIZERS)]
ModeName = Literal[("auto", *MODES)]
DtypeName = Literal[("auto", *DTYPES)]
GgufTypeName = Literal[tuple(GGUF_TYPES)]
_NOT_SHAPE_FLAGS = ("vocab_size", "tie_word_embeddings")  # the tokenizer decides; --tie-embeddings
# --eval-tokens' default and its cost: the windows scoring 32,768 tokens of the sample corpus
# compute ~64k positions forward (their context too) and the lm_head at the scored ones, about
# two training steps of the small preset at batch 32 x 256 (docs/benchmarks-history.md, issue 31).
EVAL_TOKENS = 32768


@dataclass
class TrainConfig(Checked):
    """One training run. Every field is a flag of train.py (``--seq-length`` for ``seq_length``)
    and a key of a ``--config`` TOML file; flags override the file."""

    # Model
    init_from: str | None = _arg(
        None,
        "initial weights of a new run (step 0, fresh optimizer): a llama_model.pth (with its "
        "llama_model.json), a Hugging Face Llama folder or hub repository id (ORG/NAME); the shape "
        "comes from it (--preset does not apply, shape flags must agree); a checkpoint to resume "
        "wins over it",
    )
    preset: PresetName = _arg("small", "model size; the shape flags below override it")
    hidden_size: int | None = _arg(None, "width of the residual stream (default: the preset's)")
    intermediate_size: int | None = _arg(None, "width of the MLP (default: the preset's)")
    num_hidden_layers: int | None = _arg(None, "decoder layers (default: the preset's)")
    num_attention_heads: int | None = _arg(None, "query heads (default: the preset's)")
    num_key_value_heads: int | None = _arg(None, "key/value heads (default: the preset's)")
    max_position_embeddings: int | None = _arg(
        None, "longest sequence the model takes (default: the preset's)"
    )
    rope_theta: float | None = _arg(None, "RoPE base (default: 10000)")
    tie_embeddings: bool | None = _arg(
        None,
        "the lm_head is the token embedding (one matrix); default: untied, or as --init-from's "
        "source is (--no-tie-embeddings unties a tied source: its lm_head starts as a copy)",
    )

    # Data
    dataset: tuple[str, ...] = _arg(
        ("sample",),
        "`sample` (embedded, offline), a local file/folder/glob, or a hub dataset name; repeat "
        "the flag to train on a mixture of sources",
    )
    dataset_weights: str | None = _arg(
        None,
        "comma list, one weight per --dataset: the share of the training tokens each source "
        "supplies (default: equal)",
    )
    sources: tuple[dict, ...] = field(
        default=(),
        metadata={
            "help": "TOML only: one [[sources]] table per source, keys dataset, weight, name, "
            "config, split, text_column, streaming (a --dataset flag replaces them)",
            "toml_only": True,
        },
    )
    dataset_config: str | None = _arg(
        None, "hub dataset configuration, e.g. sample-10BT for HuggingFaceFW/fineweb"
    )
    split: str = _arg("train", "the split to train on")
    text_column: str = _arg("text", "the column holding the documents")
    streaming: bool = _arg(False, "stream a hub dataset instead of downloading it whole")
    val_fraction: float = _arg(
        0.01, "held out for validation when the dataset has no validation split"
    )
    tokenizer: str = _arg(
        "auto",
        "a tokenizer.json, a folder with one (and its tokenizer_config.json), a hub repository "
        "id, or `auto`: train one on the corpus (cached) the first time",
    )
    vocab_size: int = _arg(
        8192, "vocabulary of the tokenizer `auto` trains; a given tokenizer decides its own"
    )
    bot_token: str | None = _arg(
        None, "the special token (name or id) that opens each document (default: the BOS)"
    )
    eot_token: str | None = _arg(
        None, "the special token (name or id) that ends each document (default: the EOS)"
    )
    pad_token: str | None = _arg(
        None, "the special token (name or id) pad mode pads with (default: the pad token)"
    )
    seq_length: int = _arg(256, "tokens per training sequence")
    packing: Literal["pack", "pad"] = _arg(
        "pack", "`pack`: documents concatenated into full windows; `pad`: one document per sequence"
    )
    document_mask: bool = _arg(
        True,
        "pack mode: each token attends only to its own document, which trains as if alone "
        "(--no-document-mask: plain causal windows that see across documents)",
    )
    cache_dir: str | None = _arg(
        None, "where tokenized data and the embedded corpus live (default ~/.cache/llama_ddp)"
    )
    num_workers: int = _arg(
        0, "DataLoader worker processes; reading cached tokens is cheap, so 0 is usually fastest"
    )
    num_proc: int | None = _arg(
        None,
        "tokenizer processes that build the token cache in the background while training runs "
        "(default: all cores)",
    )

    # Optimization
    batch_size: int = _arg(
        32, "global batch in sequences per optimizer step, the same at every world size"
    )
    micro_batch_size: int | None = _arg(
        None, "sequences per process per forward (default: batch size / processes)"
    )
    epochs: int = _arg(1, "passes over the data when --max-steps is not given")
    max_steps: int | None = _arg(
        None, "optimizer steps to run; overrides epochs (the data is cycled as needed)"
    )
    optimizer: OptimizerName | None = _arg(
        None,
        f"{_choices(OPTIMIZERS)} (default: the checkpoint's when a run resumes; adamw with "
        "--init-from (the optimizer open models are trained with); muon otherwise, in every "
        "mode)",
    )
    lr: float | None = _arg(
        None,
        "peak learning rate (default: the optimizer's: "
        + ", ".join(f"{name} {kind.lr:g}" for name, kind in OPTIMIZERS.items())
        + ")",
    )
    min_lr: float = _arg(1e-4, "learning rate at the end of the decay (cosine, wsd, linear)")
    warmup_steps: int | None = _arg(
        None,
        "linear warmup steps from 0.1 x lr (default: 100, or a tenth of a shorter run; a "
        "resumed run keeps the warmup it started with)",
    )
    lr_schedule: ScheduleName = _arg("cosine", f"after the warmup. {_choices(SCHEDULES)}")
    decay_fraction: float = _arg(0.2, "wsd: the fraction of the steps (the last) that decay")
    weight_decay: float = _arg(0.1, "weight decay of the matrices (not of norms), decoupled")
    beta1: float = _arg(0.9, "AdamW beta1 (Muon's momentum is 0.95)")
    beta2: float = _arg(0.99, "AdamW beta2")
    grad_clip: float = _arg(1.0, "clip the global gradient norm to this; 0 disables clipping")

    # Runtime
    mode: ModeName = _arg("auto", f"auto: ddp under torchrun, else single; {_choices(MODES)}")
    device: Literal["auto", "cpu", "cuda"] = _arg("auto", "auto: cuda when a GPU is visible")
    dtype: DtypeName = _arg(
        "auto",
        "autocast dtype; auto: bf16 where the device multiplies it natively (CUDA GPUs of compute "
        "capability 8+, CPUs with AVX512-BF16 or AMX), fp16 on older GPUs, fp32 on other CPUs; "
        "a resumed run keeps the dtype it started with (the start-up lines say which and why)",
    )
    compile: bool | None = _arg(
        None,
        "torch.compile each decoder layer; default: auto, on for CUDA, off for the CPU and "
        "--mode dp (the run's first lines say which and why; --no-compile turns it off)",
    )
    activation_checkpointing: bool = _arg(
        False, "recompute each decoder layer in the backward instead of keeping its activations"
    )
    seed: int = _arg(1337, "seed of the initial weights and the data order")

    # Output
    out_dir: str = _arg("out", "the run folder: checkpoints, metrics, exported model")
    save_every: int = _arg(0, "checkpoint every N steps; 0: only at the end")
    keep_last: int = _arg(2, "checkpoints kept; older ones are pruned once a newer one is complete")
    resume: str = _arg(
        "auto", "auto (newest complete checkpoint in out_dir, if any), none, or a checkpoint folder"
    )
    eval_every: int = _arg(0, "evaluate every N steps (and always at the end); 0: only at the end")
    eval_tokens: str = _arg(
        str(EVAL_TOKENS),
        "held-out tokens each evaluation scores: a fixed sample of the validation windows, the "
        "same at every evaluation, world size and resume (`all`: every held-out token, whose "
        "cost grows with the corpus up to 2,000 documents). The default costs about two "
        "training steps of the small preset at batch 32 x 256 (at --eval-every 40: ~5 percent "
        "of the training time)",
    )
    eval_tasks: str | None = _arg(
        None,
        f"comma list of multiple-choice tasks scored at each evaluation: {', '.join(TASKS)}, "
        "NAME=PATH (a hub task's local copy) or a .jsonl file (one {context, choices, label} "
        "per line)",
    )
    eval_limit: int = _arg(500, "examples of each --eval-tasks task scored (its first N)")
    log_every: int = _arg(10, "log a metrics line every N steps")
    log_to: str | None = _arg(
        None, f"comma list of loggers that also get the scalars of metrics.jsonl. {_choices(SINKS)}"
    )
    profile_steps: str | None = _arg(
        None,
        "A:B: a torch.profiler trace of optimizer steps A to B into out_dir/profile/ (Perfetto, "
        "TensorBoard; docs/performance.md)",
    )
    peak_tflops: float | None = _arg(
        None, "peak TFLOP/s of one device for MFU; default: a table of GPUs, or measured on CPU"
    )
    export_hf: bool = _arg(True, "also write out_dir/hf/ for transformers")
    export_gguf: GgufTypeName | None = field(
        default=None,
        metadata={
            "help": "also write out_dir/model.gguf for llama.cpp and ollama, its matrices as "
            f"the type given (alone: {DEFAULT_TYPE}). {_choices(GGUF_TYPES)}",
            "const": DEFAULT_TYPE,  # the flag alone
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.dataset, str):  # one source, as a Python caller writes it
            self.dataset = (self.dataset,)
        self.dataset, self.sources = tuple(self.dataset), tuple(self.sources)

    # ----------------------------------------------------------------- checks and derived values

    def validate(self) -> TrainConfig:
        """Every check that needs no data and no device, in one place, before any work."""
        self._check_values()
        self._check_combinations()
        return self

    def optimizer_name(self, saved: str | None = None) -> str:
        """--optimizer; else ``saved``, the one of the checkpoint the run resumes; else adamw
        for --init-from, muon otherwise."""
        return self.optimizer or saved or ("adamw" if self.init_from is not None else "muon")

    def peak_lr(self) -> float:
        """--lr, else the default of the optimizer (`optimizer_name`)."""
        return self.lr if self.lr is not None else OPTIMIZERS[self.optimizer_name()].lr

    def settle(self, saved_optimizer: str | None = None) -> TrainConfig:
        """This config with its optimizer and learning rate decided (the checkpoint a run
        resumes trained with ``saved_optimizer``), checked again."""
        named = replace(self, optimizer=self.optimizer_name(saved_optimizer))
        settled = replace(named, lr=named.peak_lr())
        settled._check_optimizer()
        return settled

    def model_config(self, vocab_size: int, source: LlamaConfig | None = None) -> LlamaConfig:
        """The model's shape: the preset, the shape flags and the tokenizer's vocabulary; or
        --init-from's ``source`` (checked against the flags by ``check_source`` before any data
        was read), whose vocabulary must cover every id of the tokenizer's ``vocab_size``."""
        if source is not None:
            if vocab_size > source.vocab_size:
                raise UserError(
                    f"the tokenizer has {vocab_size} tokens, more than the {source.vocab_size} "
                    f"of --init-from {self.init_from} (use the tokenizer the source was trained "
                    "with)"
                )
            return replace(source, tie_word_embeddings=self.tied(source))
        config = preset(
            self.preset,
            vocab_size=vocab_size,
            tie_word_embeddings=self.tied(),
            **self._shape_flags(),
        )
        self._check_seq_length(config, "lower --seq-length or raise --max-position-embeddings")
        return config

    def check_source(self, source: LlamaConfig) -> None:
        """--init-from's shape against the shape flags given (each must agree with it) and
        --seq-length; run before any data is read."""
        clashes = [
            f"--{flag_name(name)} {value} contradicts its {name} {getattr(source, name)}"
            for name, value in self._shape_flags().items()
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
        self._check_seq_length(source, "lower --seq-length")

    def tied(self, source: LlamaConfig | None = None) -> bool:
        """Whether the model ties its lm_head to its embedding: --tie-embeddings if given, else
        as the source is (untied from scratch)."""
        if self.tie_embeddings is not None:
            return self.tie_embeddings
        return source is not None and source.tie_word_embeddings

    def roles(self) -> dict[str, str | None]:
        """--bot-token, --eot-token, --pad-token (None: the tokenizer's own)."""
        return {"bot": self.bot_token, "eot": self.eot_token, "pad": self.pad_token}

    def _shape_flags(self) -> dict[str, Any]:
        names = [f.name for f in fields(LlamaConfig) if f.name not in _NOT_SHAPE_FLAGS]
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}

    def _check_seq_length(self, config: LlamaConfig, fix: str) -> None:
        if self.seq_length > config.max_position_embeddings:
            raise UserError(
                f"--seq-length {self.seq_length} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings} ({fix})"
            )

    def mixture(self) -> list[Source]:
        """The sources to train on, with their weights (sources.py)."""
        defaults = {"config": self.dataset_config, "split": self.split}
        defaults |= {"text_column": self.text_column, "streaming": self.streaming}
        return resolve_sources(self.dataset, self.dataset_weights, self.sources, defaults)

    def loggers(self) -> list[str]:
        """The names in --log-to, in order, once each."""
        names = [n.strip() for n in (self.log_to or "").split(",")]
        return list(dict.fromkeys(n for n in names if n and n != "none"))

    def task_specs(self) -> list[TaskSpec]:
        """The tasks of --eval-tasks (tasks.py), checked without reading their data."""
        return parse_tasks(self.eval_tasks)

    def eval_budget(self) -> int | None:
        """The held-out tokens an evaluation scores (--eval-tokens); None: all of them."""
        if self.eval_tokens == "all":
            return None
        try:
            tokens = int(self.eval_tokens)
        except ValueError:
            tokens = 0
        if tokens <= 0:
            raise UserError(
                f"--eval-tokens must be a positive number or `all`, got {self.eval_tokens!r}"
            )
        return tokens

    def micro_batch(self, world_size: int) -> int:
        return micro_batch_size(self.batch_size, self.micro_batch_size, world_size)

    def data_settings(self, world_size: int) -> DataSettings:
        """What the data layer needs of this run at ``world_size`` processes."""
        return DataSettings(
            sources=self.mixture(),
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            roles=self.roles(),
            packing=self.packing,
            seq_length=self.seq_length,
            document_mask=self.document_mask,
            global_batch=self.batch_size,
            micro_batch=self.micro_batch(world_size),
            seed=self.seed,
            val_fraction=self.val_fraction,
            cache_dir=Path(self.cache_dir) if self.cache_dir else None,
            num_proc=self.num_proc,
            num_workers=self.num_workers,
            sized=self.max_steps is None,
        )

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.max_steps or self.epochs * steps_per_epoch

    def warmup(self, total_steps: int) -> int:
        """Warmup steps: the flag, else 100, never more than a tenth of the run."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(100, max(1, total_steps // 10))
