"""Numeric precision: the dtype vocabulary shared by train.py and generate, autocast, loss scaling.

One vocabulary (``fp32``, ``bf16``, ``fp16``; ``auto`` picks per device) names the compute dtype
everywhere. Training computes under autocast in that dtype with fp32 weights; fp16 adds a gradient
scaler, whose state is saved with the run.
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
    """``auto``: bf16 on CUDA GPUs that compute it natively (compute capability 8 and up:
    Ampere, Hopper, ...), fp16 with loss scaling on older ones (V100, T4: bf16 is emulated there),
    fp32 on CPU (where bf16 matmul is not always faster)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    if name == "fp16" and device.type != "cuda":
        raise UserError("--dtype fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    return DTYPES[name]


class LossScaler(torch.amp.GradScaler):
    """torch's gradient scaler as a checkpoint part that resumes across precisions. A scaler
    that is off (fp32, bf16) has no state (``{}``, saved as null) and ignores a saved one; an fp16
    run resumed from a checkpoint saved without loss scaling keeps its fresh scale."""

    def load_state_dict(self, state_dict: dict | None) -> None:
        if state_dict:
            super().load_state_dict(state_dict)


class Precision:
    """The compute dtype of a run: its autocast context and its gradient scaler."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device_type = device.type
        self.scaler = LossScaler(device.type, enabled=dtype == torch.float16)

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]

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
