"""precision.py: which dtype `auto` picks where, the dtype names, TF32 on CUDA only."""

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.precision import allow_tf32, resolve_dtype

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
