"""Configuration: one training run (TrainConfig), composed of each component's settings, declared
beside the component (torchtitan's per-component ``Config``): the model's (model/config.py), the
data's (data/sources.py), the optimizer's and the schedule's (train/optim.py), the evaluation's
(train/validation.py), the checkpoints' (checkpoint/manager.py); the runtime's and the output's,
whose choices come from registries of several layers, are here. Every field of a component
carries its default and help text and, through its type, its choices: `FLAGS`, the one flag
table, maps each field to its component, and the CLI, TOML files and ``--help`` are derived from
it (cli.py). A choice (mode, dtype, schedule,
preset, logger) is read from the one registry that defines it, never listed here.

Each component checks its own values (``validate``); `TrainConfig.validate` runs them all, then
the checks across components, once, before any data is read.
"""

from __future__ import annotations

import importlib.util
import os
import time
import typing
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Literal

from llama_ddp.attention_plan.backends import ORDER
from llama_ddp.checkpoint.manager import CheckpointSettings
from llama_ddp.data.sources import DataSettings
from llama_ddp.distributed.compile_plan import PlannedRun, compile_choice
from llama_ddp.distributed.parallelize import MODES
from llama_ddp.distributed.runtime import Runtime
from llama_ddp.errors import UserError
from llama_ddp.interop.gguf_export import DEFAULT_TYPE, GGUF_TYPES, check_available
from llama_ddp.model import family
from llama_ddp.model.config import AUTO, LlamaConfig, ModelSettings
from llama_ddp.precision import DTYPES
from llama_ddp.settings import Settings, choices_help, flag_name, setting
from llama_ddp.train.budget.budget import (
    EVAL_TOKEN_STEPS,
    HELD_OUT_GUESS,
    Budget,
    make_budget,
    spent_of,
)
from llama_ddp.train.budget.duration import parse_duration
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.optim import OptimizerSettings, ScheduleSettings
from llama_ddp.train.speed import check_steps, parse_steps
from llama_ddp.train.validation import EvalSettings

ModeName = Literal[("auto", *MODES)]
DtypeName = Literal[("auto", *DTYPES)]
AttentionName = Literal[("auto", *ORDER)]
GgufTypeName = Literal[tuple(GGUF_TYPES)]


# A downstream example's tokens (all its choices), where the tasks are not loaded yet: hellaswag's
# 323.5, the longest of the built-in tasks (stdlib-mc 177.9, piqa 96.0; docs/benchmarks-history.md).
# Scored at a third of a training step's cost per token, base's hellaswag example comes to 1.02 s
# of its 77.6-s step of 8,192 tokens on 2 cores, against 0.968 s measured.
TASK_EXAMPLE_TOKENS = 324


@dataclass
class RuntimeSettings(Settings):
    """How the run executes: its mode and device, precision, compile and activation
    checkpointing, the seed, and what is measured (profile, MFU)."""

    mode: ModeName = setting(
        "auto", f"auto: ddp under torchrun, else single; {choices_help(MODES)}"
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: cuda when a GPU is visible")
    dtype: DtypeName = setting(
        "auto",
        "autocast dtype; auto: bf16 where the device multiplies it natively (CUDA GPUs of compute "
        "capability 8+, CPUs with AVX512-BF16 or AMX), fp16 on older GPUs, fp32 on other CPUs; "
        "a resumed run keeps the dtype it started with (the start-up lines say which and why)",
    )
    compile: bool | None = setting(
        None,
        "torch.compile each decoder layer; default: auto, on for CUDA, on the CPU where the "
        "planned run is long enough to repay a cold compile, off for --mode dp (the run's first "
        "lines say which and why, with the estimate; --no-compile turns it off)",
    )
    attention: AttentionName = setting(
        "auto",
        "the attention kernel for packed documents; auto: of those that run here (fa4, fa3, "
        "flash-varlen, cudnn on CUDA), the fastest on this run's shape once proven exact; sdpa "
        "and grids are the fallbacks (the start-up lines say which was taken and why)",
    )
    activation_checkpointing: bool = setting(
        False, "recompute each decoder layer in the backward instead of keeping its activations"
    )
    seed: int = setting(1337, "seed of the initial weights and the data order")
    profile_steps: str | None = setting(
        None,
        "A:B: a torch.profiler trace of optimizer steps A to B into out_dir/profile/ (Perfetto, "
        "TensorBoard; docs/performance.md)",
    )
    peak_tflops: float | None = setting(
        None, "peak TFLOP/s of one device for MFU; default: a table of GPUs, or measured on CPU"
    )

    def check(self) -> None:
        self.positive("peak_tflops")
        if self.mode == "dp" and self.compile:
            raise UserError(
                "--compile does not work with --mode dp: DataParallel copies the module on every "
                "forward, which breaks a compiled one (use DDP, which compiles: torchrun "
                "--standalone --nproc_per_node=N train.py --compile)"
            )
        self.profile()

    def profile(self) -> tuple[int, int] | None:
        """The optimizer steps --profile-steps traces (first, last), if any."""
        return parse_steps(self.profile_steps) if self.profile_steps is not None else None


@dataclass
class OutputSettings(Settings):
    """What the run writes besides its checkpoints: metrics lines, loggers, the export."""

    log_every: int = setting(10, "log a metrics line every N steps")
    log_to: str | None = setting(
        None,
        f"comma list of loggers that also get the scalars of metrics.jsonl. {choices_help(SINKS)}",
    )
    export_hf: bool = setting(True, "also write out_dir/hf/ for transformers")
    export_gguf: GgufTypeName | None = setting(
        None,
        "also write out_dir/model.gguf for llama.cpp and ollama, its matrices as the type given "
        f"(alone: {DEFAULT_TYPE}). {choices_help(GGUF_TYPES)}",
        const=DEFAULT_TYPE,  # the flag alone
    )

    def check(self) -> None:
        self.positive("log_every")
        for name in self.loggers():
            if name not in SINKS:
                raise UserError(f"--log-to {name!r} is not one of: {', '.join(SINKS)}")
            package = SINKS[name].package
            if importlib.util.find_spec(package) is None:
                raise UserError(
                    f"--log-to {name} needs the {package} package (pip install "
                    f"'llama_ddp[{package}]')"
                )
        if self.export_gguf is not None:
            check_available()

    def loggers(self) -> list[str]:
        """The names in --log-to, in order, once each."""
        names = [n.strip() for n in (self.log_to or "").split(",")]
        return list(dict.fromkeys(n for n in names if n and n != "none"))


@dataclass
class TrainConfig:
    """One training run: each component's settings. Every field of a component is a flag of
    train.py (``--seq-length`` for ``data.seq_length``) and a key of a ``--config`` TOML file;
    flags override the file."""

    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    output: OutputSettings = field(default_factory=OutputSettings)

    @classmethod
    def from_flags(cls, **values: Any) -> TrainConfig:
        """A config from flag values by field name (``seq_length=64``), each into its
        component (`FLAGS`); the others keep their defaults."""
        unknown = sorted(set(values) - set(FLAGS))
        if unknown:
            raise TypeError(f"TrainConfig has no setting {', '.join(unknown)}")
        parts: dict[str, dict[str, Any]] = {f.name: {} for f in fields(cls)}
        for name, value in values.items():
            parts[FLAGS[name].component][name] = value
        kinds = typing.get_type_hints(cls)
        return cls(**{part: kinds[part](**given) for part, given in parts.items()})

    def flags(self) -> dict[str, Any]:
        """Every setting by its field name, as the flags and a TOML file name them."""
        return {name: getattr(self.component(name), name) for name in FLAGS}

    def component(self, name: str) -> Settings:
        """The component whose field the setting ``name`` is."""
        return getattr(self, FLAGS[name].component)

    # ----------------------------------------------------------------- checks and derived values

    def validate(self) -> TrainConfig:
        """Every check that needs no data and no device, in one place, before any work: each
        component's, then those across components."""
        for f in fields(self):
            getattr(self, f.name).validate()
        self._check_lr()
        if self.schedule.time_budget is not None:
            parse_duration(self.schedule.time_budget, os.environ, time.time())
        if self.schedule.max_steps is not None:  # else known once the data is (run.py)
            check_steps(self.runtime.profile(), self.schedule.max_steps)
        self._check_model_size()
        if self.model.init_from is None:
            if self.model.model_size != AUTO:  # auto's: once chosen (train/sizing/)
                self.model_config(vocab_size=self.data.vocab_size)  # shape errors before data
        elif self.data.tokenizer == "auto":
            raise UserError(
                "--init-from needs the tokenizer its model was trained with, not a new one (pass "
                "--tokenizer: the source's folder, or the tokenizer.json beside its .pth)"
            )
        return self

    def _check_model_size(self) -> None:
        """--model-size auto needs a time budget to choose by, and neither auto nor a depth
        goes with --init-from, whose source has its shape."""
        size = self.model.model_size
        if size is None:
            return
        if self.model.init_from is not None:
            raise UserError(
                f"--model-size {size} and --init-from {self.model.init_from} both set the model's "
                "shape (drop --model-size: the shape comes from the source)"
            )
        if size == AUTO and self.schedule.time_budget is None:
            raise UserError(
                "--model-size auto chooses the size that learns most in the time given, and no "
                "time is given (add --time-budget, e.g. 10m, or give a depth: --model-size 4)"
            )
        derived = [n for n in family.DERIVED if getattr(self.model, n) is not None]
        if size == AUTO and derived:
            raise UserError(
                f"--model-size auto derives the model's {', '.join(derived)} from the size it "
                f"chooses (drop --{' and --'.join(flag_name(n) for n in derived)}, or give a "
                "depth: --model-size 4)"
            )

    def compiles(
        self, rt: Runtime, config: LlamaConfig, steps: int, done: dict | None = None
    ) -> tuple[bool, str]:
        """Whether the run compiles and why (`compile_choice`; auto on the CPU weighs the eager
        seconds left: --time-budget's, else ``steps`` of this batch; a resumed run's ``done``,
        its checkpoint's train state, less what it trained and spent)."""
        done = done or {}
        if self.schedule.time_budget is None:
            batch, seq = self.data.batch_size, self.data.seq_length
            left = max(0, steps - int(done.get("step", 0)))
            planned = PlannedRun.of_steps(config, left, batch, seq)
        else:
            seconds = parse_duration(self.schedule.time_budget, os.environ, time.time())
            if self.schedule.time_budget != "slurm":  # slurm's is the job's time left already
                seconds = max(0.0, seconds - spent_of(done))
            shape = config.num_hidden_layers, config.hidden_size
            planned = PlannedRun(*shape, seconds, f"the {seconds:.0f} s budget")
        return compile_choice(self.runtime.compile, rt.device, rt.mode, planned)

    def time_budget(
        self, parameters: int, age: float | None, *, task_tokens: int | None = None
    ) -> Budget | None:
        """--time-budget's `Budget` (None: none) for a model of ``parameters``, its clock
        started ``age`` seconds ago; the final evaluation estimated in training steps until one
        is measured: the held-out tokens (EVAL_TOKENS, 32,768 scored tokens, cost about 2 steps
        of 8,192; `all`: HELD_OUT_GUESS steps until the split's size is known, `Budget.held_out`)
        and the --eval-tasks' ``task_tokens`` (their requests' tokens; None: `TASK_EXAMPLE_TOKENS`
        an example of --eval-limit), each forward a third of a step's (forward and backward) work
        per token."""
        if self.schedule.time_budget is None:
            return None
        tokens, step_tokens = self.eval.budget(), self.data.batch_size * self.data.seq_length
        if task_tokens is None:
            task_tokens = len(self.eval.task_specs()) * self.eval.eval_limit * TASK_EXAMPLE_TOKENS
        guess = HELD_OUT_GUESS if tokens is None else 0.0  # `all`: until the split is built
        held_out = guess or EVAL_TOKEN_STEPS * tokens / step_tokens
        return make_budget(
            self.schedule.time_budget,
            parameters=parameters,
            exports=1 + self.output.export_hf + (self.output.export_gguf is not None),
            eval_steps=held_out + task_tokens / (3 * step_tokens),
            warmup=self.schedule.warmup_steps,
            decay_fraction=self.schedule.decay_fraction,
            tokens_per_step=step_tokens,
            age=age,
            env=os.environ,
            held_out_guess=guess,
        )

    def optimizer_name(self, saved: str | None = None) -> str:
        """--optimizer; else ``saved``, the one of the checkpoint the run resumes; else adamw
        for --init-from, muon otherwise."""
        return (
            self.optim.optimizer
            or saved
            or ("adamw" if self.model.init_from is not None else "muon")
        )

    def settle(self, saved_optimizer: str | None = None) -> TrainConfig:
        """This config with its optimizer and learning rate decided (the checkpoint a run
        resumes trained with ``saved_optimizer``), checked again."""
        name, scale = self.optimizer_name(saved_optimizer), self.model.lr_scale()
        settled = replace(self, optim=self.optim.settled(name, scale))
        settled._check_lr()
        return settled

    def _check_lr(self) -> None:
        """The peak lr (--lr or the optimizer's default) against the schedule's --min-lr."""
        lr = self.optim.peak_lr(self.optimizer_name(), self.model.lr_scale())
        if not (lr > 0 and 0 <= self.schedule.min_lr <= lr):
            raise UserError(
                f"need 0 <= --min-lr <= --lr and --lr > 0 (got {self.schedule.min_lr}, {lr})"
            )

    def model_config(self, vocab_size: int, source: LlamaConfig | None = None) -> LlamaConfig:
        """The model's shape (`ModelSettings.shape`), which must take --seq-length tokens."""
        config = self.model.shape(vocab_size, source)
        if source is None:
            self._check_seq_length(config, "lower --seq-length or raise --max-position-embeddings")
        return config

    def check_source(self, source: LlamaConfig) -> None:
        """--init-from's shape against the shape flags given (each must agree with it) and
        --seq-length; run before any data is read."""
        self.model.check_source(source)
        self._check_seq_length(source, "lower --seq-length")

    def _check_seq_length(self, config: LlamaConfig, fix: str) -> None:
        seq_length = self.data.seq_length
        if seq_length > config.max_position_embeddings:
            raise UserError(
                f"--seq-length {seq_length} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings} ({fix})"
            )


class Flag(typing.NamedTuple):
    """One row of the flag table: a setting's component (TrainConfig's field), its dataclass
    field (default, help) and its type hint (value type, choices)."""

    component: str
    field: Field
    hint: Any


def _flag_table() -> dict[str, Flag]:
    table = {}
    for part, kind in typing.get_type_hints(TrainConfig).items():
        hints = typing.get_type_hints(kind)
        for f in fields(kind):
            if f.name in table:  # one name, one flag: a TOML key must say which it sets
                raise TypeError(f"{f.name} is a setting of {table[f.name].component} and {part}")
            table[f.name] = Flag(part, f, hints[f.name])
    return table


# The one flag table: every setting's field name -> its component, field and type, in the order
# --help lists them.
FLAGS: dict[str, Flag] = _flag_table()
