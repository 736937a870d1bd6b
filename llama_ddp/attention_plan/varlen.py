"""torch's flash varlen attention as the installed torch defines it, and which attention kernel a
run gets, and why.

``torch_attn::_varlen_attn`` and ``torch_attn::_varlen_attn_backward`` (registered by
``torch.nn.attention.varlen``, torch 2.10 and later: neither 2.9.0 nor 2.9.1 has that module)
are private: their arguments changed between releases (torch's own torch/nn/attention/varlen.py):

- 2.10: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False)``; backward
  ``(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
  rng_state)``;
- 2.11: both add ``scale=None, window_size=None``;
- 2.12, 2.13: the forward adds ``enable_gqa=False, seqused_k=None, block_table=None,
  num_splits=None`` (``cu_seq_k`` may be None);
- a later revision: the forward has ``k_cache, v_cache, cache_seqlens, cache_batch_idx,
  page_table, seqused_k`` (all None by default) after ``window_size``, and no ``enable_gqa``.

`bind` reads the ops' schemas once and calls them by keyword: causal (``is_causal``, and
``window_size`` (-1, 0) where there is one), grouped-query attention (``enable_gqa`` where there is
one: flash takes fewer key/value heads natively), every other argument at its default. A schema
with an argument not named above, or a required one we do not give, is one this code does not
know: the run takes the ``sdpa`` kernel instead, and the banner says so (`describe`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

Tensor = torch.Tensor
HALF = (torch.float16, torch.bfloat16)
_CAUSAL = [-1, 0]  # flash's window (left, right): causal
# The arguments of each op that this code knows: what it gives, and what it leaves at None/False.
_GIVEN = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal"}
_FORWARD = _GIVEN | {"scale", "window_size", "enable_gqa", "seqused_k", "block_table"}
_FORWARD |= {"num_splits", "k_cache", "v_cache", "cache_seqlens", "cache_batch_idx", "page_table"}
_GIVEN_BACK = _GIVEN | {"grad_out", "out", "lse", "rng_state"}
_BACKWARD = _GIVEN_BACK | {"scale", "window_size"}
# The sdpa kernel's backward holds (rows, H, W, W) fp32 probabilities for this many bytes at most.
PROBABILITY_BYTES = 2**28


@dataclass(frozen=True)
class VarlenOps:
    """The forward and backward varlen ops of this torch, and the argument names each takes."""

    forward_op: Any
    backward_op: Any
    forward_args: frozenset[str]
    backward_args: frozenset[str]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> tuple:
        """(out (N, H, D), lse) of causal attention of (N, H, D) q over (N, K, D) k, v within the
        segments ``cu``."""
        kwargs = dict(query=q, key=k, value=v, cu_seq_q=cu, cu_seq_k=cu, max_q=max_len)
        kwargs |= dict(max_k=max_len, is_causal=True)
        if "window_size" in self.forward_args:
            kwargs["window_size"] = _CAUSAL
        if "enable_gqa" in self.forward_args:
            kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
        out, lse, _ = self.forward_op(**kwargs)
        return out, lse

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 cu: Tensor, max_len: int) -> tuple:  # fmt: skip
        """(dq, dk, dv) of `forward` for the output gradient ``grad``."""
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
        kwargs = dict(grad_out=grad, query=q, key=k, value=v, out=out, lse=lse, cu_seq_q=cu)
        kwargs |= dict(cu_seq_k=cu, max_q=max_len, max_k=max_len, is_causal=True, rng_state=rng)
        if "window_size" in self.backward_args:
            kwargs["window_size"] = _CAUSAL
        return tuple(self.backward_op(**kwargs))


def lse_shape(q: Tensor, cu: Tensor, max_len: int) -> tuple[int, ...]:
    """The shape of the log-sum-exp the forward returns for (N, H, D) ``q`` in the segments
    ``cu``: (H, N); on ROCm (segments, H, max_len), padded per segment, as torch's own fake of
    the op says (torch.version.hip)."""
    n, h, _ = q.shape
    return (cu.shape[0] - 1, h, max_len) if torch.version.hip else (h, n)


def bind(forward_op: Any, backward_op: Any) -> VarlenOps | str:
    """The ops bound by their schemas, or why they cannot be: an argument this code does not
    know, or a required one it does not give."""
    names = []
    for op, known, given in ((forward_op, _FORWARD, _GIVEN), (backward_op, _BACKWARD, _GIVEN_BACK)):
        schema = op.default._schema
        args = {a.name: a for a in schema.arguments}
        unknown = sorted(set(args) - known)
        missing = sorted(n for n, a in args.items() if n not in given and not a.has_default_value())
        if unknown or missing or len(schema.returns) != 3:
            what = "no default for" if missing and not unknown else "an argument"
            name = (unknown or missing or ["(its results)"])[0]
            return f"its {schema.name} has {what} {name!r} that llama_ddp does not know"
        names.append(frozenset(args))
    return VarlenOps(forward_op, backward_op, *names)


_NEWER_TORCH = "torch 2.10 to 2.13 (e.g. TORCH_VERSION=2.13.0 make install)"


@functools.cache
def installed() -> VarlenOps | Fallback:
    """This torch's varlen ops bound (`bind`), or why there are none."""
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers the ops
    except ImportError:
        return Fallback(f"torch {torch.__version__} has no flash varlen attention", _NEWER_TORCH)
    ns = torch.ops.torch_attn
    if not (hasattr(ns, "_varlen_attn") and hasattr(ns, "_varlen_attn_backward")):
        return Fallback(f"torch {torch.__version__} has no flash varlen op", _NEWER_TORCH)
    bound = bind(ns._varlen_attn, ns._varlen_attn_backward)
    if isinstance(bound, VarlenOps):
        return bound
    return Fallback(f"torch {torch.__version__}: {bound}", f"{_NEWER_TORCH}, or report it")


@dataclass(frozen=True)
class Fallback:
    """Why the fast kernel cannot run, and what would give it."""

    why: str
    remedy: str


def fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash takes tensors of ``dtype`` with heads of ``head_dim``."""
    return dtype in HALF and head_dim % 8 == 0 and head_dim <= 256


def device_problem(device: torch.device) -> Fallback | None:
    """Why CUDA ``device`` cannot run torch's flash varlen kernel, or None when it can."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        name = torch.cuda.get_device_name(device)
        return Fallback(
            f"{name} is compute capability {major}.{minor}",
            "a GPU of compute capability 8.0 or newer (A100, L4, H100, RTX 30xx and later)",
        )
    bound = installed()
    return None if isinstance(bound, VarlenOps) else bound


def choose(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, Fallback | None]:
    """The attention kernel a model on ``device`` computing in ``dtype`` with heads of
    ``head_dim`` runs (attention.py), and for the ``sdpa`` fallback why (None for the others)."""
    if device.type == "cpu":
        return "grids", None
    if device.type != "cuda":
        return "sdpa", Fallback(f"{device.type} is no CUDA device", "a CUDA GPU")
    problem = device_problem(device)
    if problem is None and fits(dtype, head_dim):
        return "varlen", None
    if problem is None and dtype not in HALF:
        name = str(dtype).removeprefix("torch.")
        problem = Fallback(f"{name} on CUDA (flash computes in bf16 or fp16)", "--dtype bf16")
    elif problem is None:
        problem = Fallback(
            f"head dim {head_dim} (flash takes a multiple of 8, at most 256)",
            "a hidden size and head count whose quotient is a multiple of 8, at most 256",
        )
    return "sdpa", problem


def describe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The run's banner line on its attention kernel; for the fallback, why, and what gives the
    fast kernel."""
    kernel, problem = choose(device, dtype, head_dim)
    if kernel == "grids":
        return "attention: the CPU flash kernel on documents bucketed into grids"
    if kernel == "varlen":
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return f"attention: flash varlen (torch {torch.__version__}, sm {capability})"
    return (
        f"attention: sdpa fallback, slower: {problem.why} (for flash varlen: {problem.remedy}); "
        f"its backward holds up to {PROBABILITY_BYTES >> 20} MB of fp32 probabilities at a time"
    )
