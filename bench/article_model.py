"""The reference article's Llama as a typical tutorial writes it: the baseline of bench_train.py.

The architecture and the weight names are llama_ddp's (so one state dict loads into both and the
logits agree), but the code takes the tutorial's usual route, the one llama_ddp.model.llama avoids:

- an explicit additive float mask (B, 1, T, T) of 0 / -inf, causal plus padding, built from the
  input ids for every batch;
- attention as ``softmax(Q K^T / sqrt(d) + mask) V`` in plain matmuls, no fused SDPA kernel;
- grouped-query attention by copying each K/V head with ``repeat_interleave``;
- RoPE's cos/sin recomputed from the inverse frequencies in every forward;
- fp32 throughout (no autocast).

Shapes: B batch, T sequence, C hidden, H query heads, K key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp.model.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryPositionEncoding(nn.Module):
    """cos/sin of the rotation angles, recomputed for every forward (no buffers)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=device).float() / d))
        positions = torch.arange(seq_len, device=device).float()
        freqs = torch.outer(positions, inv_freq)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def create_attention_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, T, T) additive mask: -inf above the diagonal and on padding keys, 0 elsewhere."""
    t = input_ids.shape[1]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
    padding = (input_ids == pad_id)[:, None, None, :]  # (B, 1, 1, T)
    mask = torch.zeros(input_ids.shape[0], 1, t, t, device=input_ids.device)
    return mask.masked_fill(causal | padding, float("-inf"))


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        c, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(c, c, bias=False)
        self.k_proj = nn.Linear(c, kv, bias=False)
        self.v_proj = nn.Linear(c, kv, bias=False)
        self.o_proj = nn.Linear(c, c, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = (
            self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        )  # (B, K, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + mask  # (B, H, T, T)
        y = F.softmax(scores, dim=-1) @ v  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.rotary_emb = RotaryPositionEncoding(config.head_dim, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, C)
        rope = self.rotary_emb(input_ids.shape[1], input_ids.device)
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.norm(x)


class LlamaForPretraining(nn.Module):
    """``model(input_ids, mask) -> logits (B, T, V)``, the mask from `create_attention_mask`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.base_model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.base_model(input_ids, mask))
