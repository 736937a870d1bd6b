"""backends.py: which attention backends a device, dtype and head size can run, and why not the
others; activation through torch's flash registry; the kernel plans get. No GPU here: the
device's capability, the installed packages and cuDNN's version are mocked."""

import pytest
import torch

from llama_ddp.attention_plan import backends, varlen
from llama_ddp.attention_plan.plan import plan_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the capability set in the returned dict, with the modules listed there
    installed, cuDNN 9, torch's varlen op and its flash registry (whatever this torch has)."""
    state = {"capability": (9, 0), "modules": {"flash_attn_interface"}, "cudnn": 90100}
    monkeypatch.setattr(backends, "_capability", lambda device: state["capability"])
    monkeypatch.setattr(backends, "_module", lambda name: name in state["modules"])
    monkeypatch.setattr(varlen, "device_problem", lambda device: None)
    monkeypatch.setattr(backends, "_torch_impl", lambda impl: None)  # torch's registry: 2.10+
    monkeypatch.setattr(backends, "undoable", lambda: True)  # 2.11+
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: state["cudnn"])
    monkeypatch.setattr(backends, "_IN_USE", {})
    return state


def names(found) -> list[str]:
    return [b.name for b in found]


def test_the_cpu_runs_the_grids_only():
    found, why = backends.available(CPU, FP32, 64)
    assert names(found) == ["grids"]
    assert why == {name: "needs CUDA" for name in ("flash-varlen", "fa3", "fa4", "cudnn", "sdpa")}
    assert names(backends.candidates(CPU, BF16, 64)[0]) == ["grids"]


def test_a_hopper_gpu_runs_what_is_installed_and_says_why_not_the_rest(gpu):
    found, why = backends.available(CUDA, BF16, 64)
    assert names(found) == ["flash-varlen", "fa3", "cudnn", "sdpa"]
    assert why == {"fa4": "not installed (pip install flash-attn-4)", "grids": "needs CPU"}
    fast, why = backends.candidates(CUDA, BF16, 64)
    assert names(fast) == ["flash-varlen", "fa3", "cudnn"]  # sdpa: only where none of them runs
    assert why["sdpa"] == "a fallback, slower"


def test_capability_cudnn_version_dtype_and_head_size_each_rule_backends_out(gpu):
    gpu["capability"], gpu["modules"] = (
        (8, 0),
        {"flash_attn_interface", "flash_attn.cute.interface"},
    )
    found, why = backends.available(CUDA, BF16, 64)
    assert names(found) == ["flash-varlen", "sdpa"]
    assert why["fa3"] == "needs compute capability 9.0, not 8.0"
    assert why["fa4"] == "needs compute capability 9.0 or 10.0, not 8.0"
    assert why["cudnn"].startswith("cuDNN attention here needs compute capability 9.0")
    gpu["capability"], gpu["cudnn"] = (10, 0), 8907
    found, why = backends.available(CUDA, BF16, 64)
    assert names(found) == ["flash-varlen", "fa4", "sdpa"]
    assert why["cudnn"] == "needs cuDNN 9 (this torch has 8907)"
    gpu["capability"], gpu["cudnn"] = (9, 0), 90100
    assert names(backends.available(CUDA, BF16, 192)[0]) == ["flash-varlen", "fa3", "fa4", "sdpa"]
    assert "at most 128 (not 192)" in backends.available(CUDA, BF16, 192)[1]["cudnn"]
    found, why = backends.candidates(CUDA, FP32, 64)
    assert names(found) == ["sdpa"]  # fp32 on CUDA: the fallback alone
    assert why["flash-varlen"] == "computes in bf16 or fp16, not float32"


def test_taking_a_backend_activates_its_flash_implementation_and_gives_plans_its_kernel(
    gpu, monkeypatch
):
    import torch.nn.attention as attention

    calls = []
    # raising=False: torch 2.9 has no flash registry; the calls are what is tested
    monkeypatch.setattr(
        attention, "activate_flash_attention_impl", lambda impl: calls.append(impl), raising=False
    )
    monkeypatch.setattr(
        attention, "current_flash_attention_impl", lambda: calls and calls[-1], raising=False
    )
    monkeypatch.setattr(
        attention, "restore_flash_attention_impl", lambda: calls.append(None), raising=False
    )
    assert backends.current_kernel(CUDA) == "varlen"  # nothing taken: the default, nothing active
    assert backends.current_kernel(CPU) == "grids"
    backends.use(backends.BACKENDS["fa3"], CUDA)
    assert calls == ["FA3"] and backends.current_kernel(CUDA) == "varlen"
    backends.use(backends.BACKENDS["flash-varlen"], CUDA)
    assert calls == ["FA3", None]  # torch's own FlashAttention 2 again
    backends.use(backends.BACKENDS["cudnn"], CUDA)
    assert calls == ["FA3", None] and backends.current_kernel(CUDA) == "cudnn"
    backends.use(backends.BACKENDS["fa4"], CUDA)
    backends.use(backends.BACKENDS["cudnn"], CUDA)  # FA4 no longer wanted: torch's own again
    assert calls == ["FA3", None, "FA4", None]
    ids = torch.zeros(2, 8, dtype=torch.long)
    plan = plan_attention(ids.shape, document_ids=ids)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # no CUDA to move to
    assert plan.kernel == "grids" and plan.to(CUDA).kernel == "cudnn"


@pytest.mark.skipif(
    not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
    reason=f"torch {torch.__version__} has no flash registry (2.10 and later)",
)
def test_this_torch_can_activate_fa3_and_fa4():
    """The registry torch 2.11+ has (torch.nn.attention._fa3, _fa4): activating them needs only
    their packages."""
    assert backends._torch_impl("FA3") is None and backends._torch_impl("FA4") is None


def test_without_a_gpu_the_default_is_the_fallback(monkeypatch):
    monkeypatch.setattr(varlen, "device_problem", lambda device: varlen.Fallback("old", "new"))
    assert backends.default(CUDA).name == "sdpa" and backends.default(CPU).name == "grids"
