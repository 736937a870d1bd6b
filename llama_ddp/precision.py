"""Numeric precision: the dtype vocabulary shared by train.py and generate, autocast, loss scaling.

One vocabulary (``fp32``, ``bf16``, ``fp16``; ``auto`` picks per device) names the compute dtype
everywhere. Training computes under autocast in that dtype with fp32 weights; fp16 adds a gradient
scaler, whose state is saved with the run. ``auto`` trains in bf16 where the device multiplies it
natively (CUDA GPUs of compute capability 8 and up; CPUs with AVX512-BF16 or AMX), fp16 on older
GPUs, fp32 on other CPUs (`training_dtype`), and a resumed run keeps the dtype it started with;
the inference tools (generate, perplexity, evaluate) keep fp32 on every CPU (`resolve_dtype`).
"""

from __future__ import annotations

import contextlib

import torch

from llama_ddp.errors import UserError

# The dtypes ``--dtype`` offers (besides ``auto``); a new one is an entry here.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# fp16's GradScaler skips a step whose gradients overflow and halves its scale: a few skips in a
# row are how it finds its scale; this many mean the loss itself is not finite and stays so.
MAX_SKIPPED_STEPS = 25


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The inference tools' dtype. ``auto``: bf16 on CUDA GPUs that compute it natively (compute
    capability 8 and up: Ampere, Hopper, ...), fp16 with loss scaling on older ones (V100, T4:
    bf16 is emulated there), fp32 on CPU (exact, and as fast as bf16 for one sequence)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    if name == "fp16" and device.type != "cuda":
        raise UserError("--dtype fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    return DTYPES[name]


def cpu_bf16_units() -> list[str]:
    """This CPU's units that multiply bf16 natively (torch's own probe): AVX512-BF16, AMX."""
    units = [("AVX512-BF16", torch.cpu._is_avx512_bf16_supported)]
    units.append(("AMX", torch.cpu._is_amx_tile_supported))
    return [name for name, probe in units if probe()]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively: a CUDA GPU of compute capability 8 and up,
    a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return bool(cpu_bf16_units())


def training_dtype(
    name: str, device: torch.device, saved: str | None = None
) -> tuple[torch.dtype, str]:
    """A training run's compute dtype and why. ``--dtype NAME`` is that dtype; ``auto`` is the
    dtype ``saved`` by the checkpoint the run resumes (a run moved to another machine keeps its
    numerics), else on CUDA as `resolve_dtype`, on a CPU bf16 where it multiplies bf16
    natively (AVX512-BF16, AMX: ~1.6x fp32's tokens/s) and fp32 elsewhere (bf16 is emulated
    there, many times slower)."""
    if name != "auto":
        return resolve_dtype(name, device), f"--dtype {name}"
    if saved is not None:
        if saved == "fp16" and device.type != "cuda":
            raise UserError(
                "the checkpoint trained in fp16, which needs a CUDA device (resume on CPU with "
                "--dtype bf16 or --dtype fp32)"
            )
        return DTYPES[saved], "auto: the checkpoint's dtype, kept on resume (--dtype changes it)"
    if device.type == "cuda":
        dtype = resolve_dtype(name, device)
        if dtype == torch.bfloat16:
            return dtype, "auto: the GPU computes bf16 natively"
        return dtype, "auto: the GPU has no native bf16 (compute capability < 8)"
    units = cpu_bf16_units()
    if units:
        return torch.bfloat16, f"auto: the CPU multiplies bf16 natively ({', '.join(units)})"
    return torch.float32, "auto: the CPU has no native bf16 (no AVX512-BF16, no AMX)"


def emulation_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning for bf16 on a CPU that does not multiply it natively, else None."""
    if dtype != torch.bfloat16 or device.type != "cpu" or cpu_bf16_units():
        return None
    return (
        "warning: bf16 on a CPU without native bf16 (no AVX512-BF16, no AMX): its matmuls are "
        "emulated, many times slower than fp32 (use --dtype fp32, or auto)"
    )


class LossScaler(torch.amp.GradScaler):
    """torch's gradient scaler as a checkpoint part that resumes across precisions. A scaler
    that is off (fp32, bf16) has no state (``{}``, saved as null) and ignores a saved one; an fp16
    run resumed from a checkpoint saved without loss scaling keeps its fresh scale."""

    def load_state_dict(self, state_dict: dict | None) -> None:
        if state_dict:
            super().load_state_dict(state_dict)


class Precision:
    """The compute dtype of a run (and why it is that one): its autocast context and its
    gradient scaler. As a checkpoint part it records the dtype, which a resumed run reads before
    its model is built (`training_dtype`): loading it back changes nothing. Checkpoints written
    before it lack it (``optional``)."""

    optional = True

    def __init__(self, dtype: torch.dtype, device: torch.device, reason: str = "") -> None:
        self.dtype, self.reason = dtype, reason
        self.device_type = device.type
        self.scaler = LossScaler(device.type, enabled=dtype == torch.float16)

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def describe(self) -> str:
        return f"precision: {self.name}" + (f" ({self.reason})" if self.reason else "")

    def state_dict(self) -> dict[str, str]:
        return {"dtype": self.name}

    def load_state_dict(self, state: dict[str, str]) -> None:
        return None  # read before the model was built: see the class docstring

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast with the dtype named explicitly: a thread that enters it computes in this
        dtype, never in the thread's own default (fp16 on CUDA)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def allow_tf32(device: torch.device) -> None:
    """fp32 matmuls on CUDA use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation):
    several times faster, and what every fp32 recipe uses; CPU runs are untouched (exact)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
