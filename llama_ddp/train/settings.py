"""The settings whose choices come from registries of several layers, so they live here at the
top: how the run executes (RuntimeSettings: processes, device, precision, compile, seed,
profiling) and what it writes beside its checkpoints (OutputSettings: metrics, loggers, the
exported model). The other components' settings live beside their code (see config.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from llama_ddp.distributed.parallelize import MODES
from llama_ddp.errors import UserError
from llama_ddp.interop.gguf_export import DEFAULT_TYPE, GGUF_TYPES, check_available
from llama_ddp.precision import DTYPES
from llama_ddp.settings import Settings, choices_help, setting
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.speed import parse_steps

ModeName = Literal[("auto", *MODES)]
DtypeName = Literal[("auto", *DTYPES)]
GgufTypeName = Literal[tuple(GGUF_TYPES)]


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
        "torch.compile each decoder layer; default: auto, on for CUDA, off for the CPU and "
        "--mode dp (the run's first lines say which and why; --no-compile turns it off)",
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
