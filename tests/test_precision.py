"""precision.py: which dtype `auto` picks where, the dtype names, TF32 on CUDA only."""

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.precision import allow_tf32, emulation_warning, resolve_dtype, training_dtype

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((7, 0), torch.float16),
        ((7, 5), torch.float16),
        ((8, 0), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_auto_dtype_uses_bf16_only_where_the_gpu_computes_it(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", CUDA) == expected  # V100/T4 emulate bf16: fp16 + loss scaling


def test_dtype_names_and_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("fp32", CUDA) == torch.float32
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        resolve_dtype("fp16", cpu)


def test_tf32_only_on_cuda():
    before = torch.get_float32_matmul_precision()
    try:
        allow_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before == "highest"
        allow_tf32(CUDA)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def native(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    """Make torch's probe of this CPU's bf16 units answer as told."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected, why",
    [
        (True, False, torch.bfloat16, "the CPU multiplies bf16 natively (AVX512-BF16)"),
        (True, True, torch.bfloat16, "the CPU multiplies bf16 natively (AVX512-BF16, AMX)"),
        (False, True, torch.bfloat16, "the CPU multiplies bf16 natively (AMX)"),
        (False, False, torch.float32, "the CPU has no native bf16 (no AVX512-BF16, no AMX)"),
    ],
)
def test_auto_trains_in_bf16_on_a_cpu_that_multiplies_it_natively(
    monkeypatch, avx512_bf16, amx, expected, why
):
    native(monkeypatch, avx512_bf16, amx)
    cpu = torch.device("cpu")
    assert training_dtype("auto", cpu) == (expected, f"auto: {why}")
    assert resolve_dtype("auto", cpu) == torch.float32  # generate, perplexity, evaluate: fp32
    assert training_dtype("fp32", cpu) == (torch.float32, "--dtype fp32")
    warning = emulation_warning(torch.bfloat16, cpu)
    assert (warning is None) == (expected == torch.bfloat16)
    assert emulation_warning(torch.float32, cpu) is None


def test_a_resumed_run_keeps_its_checkpoints_dtype_unless_told(monkeypatch):
    native(monkeypatch, False, False)
    cpu, kept = (
        torch.device("cpu"),
        "auto: the checkpoint's dtype, kept on resume (--dtype changes it)",
    )
    assert training_dtype("auto", cpu, saved="bf16") == (torch.bfloat16, kept)
    assert training_dtype("fp32", cpu, saved="bf16") == (torch.float32, "--dtype fp32")
    native(monkeypatch, True, True)
    assert training_dtype("auto", cpu, saved="fp32") == (torch.float32, kept)
    with pytest.raises(UserError, match="trained in fp16, which needs a CUDA device"):
        training_dtype("auto", cpu, saved="fp16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert training_dtype("auto", CUDA, saved="fp16") == (torch.float16, kept)
    assert training_dtype("auto", CUDA) == (torch.bfloat16, "auto: the GPU computes bf16 natively")
