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
    """The plan's kernel (its backend's, backends.py) where the dtype and head size fit it, else
    the device's fallback."""
    varlen, cudnn, sdpa = (types.SimpleNamespace(kernel=k) for k in ("varlen", "cudnn", "sdpa"))
    cpu = torch.empty(4, 2, 16)
    gpu_like = torch.empty(4, 2, 16, device="meta")  # stands for a CUDA tensor
    assert kernel_for(cpu, varlen) == "grids"
    assert kernel_for(gpu_like.bfloat16(), varlen) == "varlen"
    assert kernel_for(gpu_like.half(), varlen) == "varlen"
    assert kernel_for(gpu_like, varlen) == "sdpa"  # fp32: flash has no fp32 kernel
    assert kernel_for(gpu_like.bfloat16(), sdpa) == "sdpa"  # a GPU without flash
    assert kernel_for(torch.empty(4, 2, 12, device="meta").bfloat16(), varlen) == "sdpa"  # head dim
    assert kernel_for(gpu_like.bfloat16(), cudnn) == "cudnn"
    assert kernel_for(gpu_like, cudnn) == "sdpa"
    assert kernel_for(torch.empty(4, 2, 192, device="meta").bfloat16(), cudnn) == "sdpa"
    assert kernel_for(torch.empty(4, 2, 192, device="meta").bfloat16(), varlen) == "varlen"


def _math_attention(q, k, v, is_causal=True):
    """(out, lse) of causal attention of (B, H, W, D) q over (B, K, W, D) k, v, lse (B, H, W, 1)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    w = q.shape[2]
    scores = scores.masked_fill(torch.ones(w, w, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return (scores - lse).exp() @ v, lse


def _fake_cudnn_forward(q, k, v, bias, lse_wanted, dropout, is_causal, debug, *, scale=None):
    assert bias is None and lse_wanted and dropout == 0.0 and is_causal and not debug
    out, lse = _math_attention(q, k, v)
    none, seed = torch.empty(0), torch.zeros((), dtype=torch.int64)
    return out, lse, none, none, q.shape[2], k.shape[2], seed, seed, none


def _fake_cudnn_backward(g, q, k, v, out, lse, seed, offset, bias, cu_q, cu_k, max_q, max_k,
                         dropout, is_causal, *, scale=None):  # fmt: skip
    """cuDNN's backward as its contract says: from the saved output and log-sum-exp (B, H, W, 1)
    alone (a layout mixed up on the way makes the gradients wrong)."""
    assert bias is None and cu_q is None and cu_k is None and dropout == 0.0 and is_causal
    assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous() and max_q == q.shape[2]
    group = q.shape[1] // k.shape[1]
    kf, vf = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5
    w = q.shape[2]
    scores = (q @ kf.transpose(-1, -2) * scale).masked_fill(
        torch.ones(w, w, dtype=torch.bool).triu(1), float("-inf")
    )
    p = (scores - lse).exp()
    dp = g @ vf.transpose(-1, -2)
    ds = p * (dp - (g * out).sum(-1, keepdim=True))
    dq, dk, dv = ds @ kf * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ g
    dk, dv = (x.view(x.shape[0], -1, group, w, x.shape[-1]).sum(2) for x in (dk, dv))
    return dq, dk, dv


@pytest.mark.parametrize("name", ["documents", "documents+padding", "padding"])
def test_the_cudnn_kernel_carries_the_grids_and_their_log_sum_exp(name, monkeypatch):
    """The ``cudnn`` kernel (a GPU's; here cuDNN's two ops stand in as their contracts say: the
    backward from the saved output and (rows, H, width, 1) log-sum-exp alone) equals the CPU
    grids kernel in values and gradients: what it moves into and out of the grids is right."""
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", _fake_cudnn_forward)
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", _fake_cudnn_backward
    )
    torch.manual_seed(0)
    plan = plans()[name]
    q, k, v = qkv(plan.positions.numel())
    grad = torch.randn(q.shape)
    args = (plan.cu_seqlens, plan.max_seqlen, plan.grids, plan.slots, plan.padding)
    results = {}
    for kernel in ("grids", "cudnn"):
        out = segment_attention(q, k, v, *args, kernel)[0]
        results[kernel] = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    for got, expected in zip(results["cudnn"], results["grids"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
