"""attention.py: causal attention within a plan's segments, one custom operator."""

import types

import pytest
import torch
import torch.nn.functional as F

from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.model.attention import attend, kernel_for, segment_attention

LENGTHS = [[5, 20, 15], [40], [1, 18, 3, 18], [9, 31]]  # documents of different widths per row


def documents(lengths_by_row: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_by_row]
    )


def plans():
    ids = documents(LENGTHS)
    real = torch.arange(40) < torch.tensor([[40], [33], [22], [9]])
    return {
        "documents": plan_attention(ids.shape, document_ids=ids),
        "documents+padding": plan_attention(ids.shape, real, ids),
        "padding": plan_attention(ids.shape, real),
    }


def qkv(n: int, requires_grad: bool = True) -> list[torch.Tensor]:
    """(n, 4, 16) queries, (n, 2, 16) keys and values: grouped-query attention."""
    return [torch.randn(n, h, 16, requires_grad=requires_grad) for h in (4, 2, 2)]


@pytest.mark.parametrize("name", ["documents", "documents+padding", "padding"])
def test_each_segment_attends_alone(name, monkeypatch):
    """The operator (CPU: grids) on a plan equals causal attention of each segment run alone, in
    values and in gradients; the fallback kernel (sdpa: any device, dtype) equals it too, its
    backward a grid row at a time."""
    import llama_ddp.model.attention

    monkeypatch.setattr(llama_ddp.model.attention, "_PROBABILITY_BYTES", 1)
    torch.manual_seed(0)
    plan = plans()[name]
    q, k, v = qkv(plan.positions.numel())
    grad = torch.randn(q.shape)
    out = attend(q, k, v, plan)
    bounds = plan.cu_seqlens.tolist()
    alone = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])
        ]
    )
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, expected in zip(grads, torch.autograd.grad(alone, (q, k, v), grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    args = (plan.cu_seqlens, plan.max_seqlen, plan.grids, plan.slots, plan.padding, "sdpa")
    fallback = segment_attention(q, k, v, *args)[0]
    torch.testing.assert_close(fallback, out, rtol=0, atol=1e-6)
    for got, expected in zip(torch.autograd.grad(fallback, (q, k, v), grad), grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_operator_passes_opcheck():
    """Schema, fake (meta) kernel, autograd registration and compiled use (aot_dispatch), for
    both CPU kernels."""
    torch.manual_seed(0)
    plan = plans()["documents+padding"]
    q, k, v = qkv(plan.positions.numel())
    for kernel in ("grids", "sdpa"):
        args = (plan.cu_seqlens, plan.max_seqlen, plan.grids, plan.slots, plan.padding, kernel)
        torch.library.opcheck(segment_attention, (q, k, v, *args))


def test_the_kernel_follows_the_device_and_dtype():
    flash, no_flash = types.SimpleNamespace(flash=True), types.SimpleNamespace(flash=False)
    cpu = torch.empty(4, 2, 16)
    gpu_like = torch.empty(4, 2, 16, device="meta")  # stands for a CUDA tensor
    assert kernel_for(cpu, no_flash) == "grids"
    assert kernel_for(gpu_like.bfloat16(), flash) == "varlen"
    assert kernel_for(gpu_like.half(), flash) == "varlen"
    assert kernel_for(gpu_like, flash) == "sdpa"  # fp32: flash has no fp32 kernel
    assert kernel_for(gpu_like.bfloat16(), no_flash) == "sdpa"  # a GPU without flash
    assert kernel_for(torch.empty(4, 2, 12, device="meta").bfloat16(), flash) == "sdpa"  # head dim
