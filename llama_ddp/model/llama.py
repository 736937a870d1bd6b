"""The Llama model: RoPE, grouped-query attention, SwiGLU MLP, RMSNorm.

Module names follow the reference article (and Hugging Face's modeling_llama.py), so a
``llama_model.pth`` state dict loads unchanged and export to Hugging Face is a renaming. The model
knows nothing of distribution or files: ``model(input_ids)`` returns logits, and with ``labels``
their summed cross-entropy (loss.py), computed without holding them whole.

Shapes: B batch, T sequence, C hidden, H query heads, K key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp.attention_plan.plan import AttentionPlan
from llama_ddp.model.attention import attend
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.loss import linear_token_loss_sum


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even under autocast: the mean of squares loses precision in bf16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, (max_position_embeddings, head_dim), Hugging Face layout."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        cos, sin = rope_tables(config)
        self.register_buffer("cos", cos, persistent=True)
        self.register_buffer("sin", sin, persistent=True)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[start : start + length], self.sin[start : start + length]  # (T, D) each


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): rotate-half convention, no permutation
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos/sin: (T, D) in fp32, cast to x's dtype as Hugging Face does.
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class KVCache:
    """Preallocated keys and values for every layer, (B, K, max_length, D): K heads, not H.

    ``position`` counts the tokens already stored; the model advances it after each forward.
    """

    def __init__(
        self,
        config: LlamaConfig,
        batch_size: int,
        max_length: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.max_length = max_length or config.max_position_embeddings
        shape = (batch_size, config.num_key_value_heads, self.max_length, config.head_dim)
        self.keys = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.position = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.position + k.shape[2]
        self.keys[layer][:, :, self.position : end] = k
        self.values[layer][:, :, self.position : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        c, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(c, c, bias=False)
        self.k_proj = nn.Linear(c, kv, bias=False)
        self.v_proj = nn.Linear(c, kv, bias=False)
        self.o_proj = nn.Linear(c, c, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if plan is not None:  # x holds the N computed tokens only
            y = self._attend_tokens(q, k, v, rope, plan)
        else:
            y = self._attend(q, k, v, rope, cache)
        return self.o_proj(y)

    def _attend_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """Attention of the (N, H*D) queries over (N, K*D) keys/values of a plan's tokens, each
        with its own (N, 1, D) RoPE row, within the plan's segments -> (N, H*D): one operator
        (llama_ddp.model.attention), whichever the device."""
        n, d = q.shape[0], self.head_dim
        q = apply_rope(q.view(n, self.n_heads, d), *rope)  # (N, H, D)
        k = apply_rope(k.view(n, self.n_kv_heads, d), *rope)  # (N, K, D)
        return attend(q, k, v.view(n, self.n_kv_heads, d), plan).view(n, -1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Causal attention of (B, T, H*D) queries over (B, T, K*D) keys/values -> (B, T, H*D);
        a token's position is its column (plus the cached prefix)."""
        b, t, c = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        cos, sin = rope[0][:t], rope[1][:t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = 0
        if cache is not None:
            start = cache.position
            k, v = cache.update(self.layer_idx, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if start == 0:
            # Right-padded sequences: the causal mask alone is exact for every real token.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif t == 1:
            # One new token attends to everything cached: no mask needed.
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            # A chunk after a cached prefix: causal, offset by the prefix length.
            mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, t, c)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        plan: AttentionPlan | None = None,
        *,
        restore: bool = True,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C); with a ``plan``, (N, C) for its N tokens, in row-major
        order (``restore=False``: in the plan's, for a caller that orders its targets instead)."""
        t = input_ids.shape[1]
        start = cache.position if cache is not None else 0
        if start + t > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {start + t} tokens exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        rope = self.rotary_emb(start, t)
        if plan is not None:
            input_ids = plan.tokens(input_ids)
            rope = plan.rope(rope)
        x = self.embed_tokens(input_ids)  # (B, T, C), or (N, C)
        for layer in self.layers:
            x = layer(x, rope, cache, plan)
        if cache is not None:
            cache.position += t
        x = self.norm(x)
        return x if plan is None or not restore else plan.restore(x)


class LlamaForPretraining(nn.Module):
    """``model(input_ids) -> logits (B, T, V)``; pass a KVCache to generate incrementally.

    With ``config.tie_word_embeddings`` the lm_head's weight is the embedding's Parameter (one
    matrix, trained once); the state dict still names both, as one tensor."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.base_model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.base_model.embed_tokens.weight
        # torch.compile's backend for the loss's chunks (loss.py), set with the layers' by
        # distributed.parallelize.compile_layers; None: eager.
        self.loss_backend: str | Callable | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each weight as `initial_value` says, drawn in place from torch's default generator
        (on the meta device: nothing drawn)."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
                std = init_std(self.config, f"{name}.weight")
                if std is None:
                    nn.init.ones_(module.weight)
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        last_only: bool = False,
        plan: AttentionPlan | None = None,
        rows: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V). Training passes the batch's attention ``plan`` (attention_plan/plan.py,
        made by the loader, already on the model's device): every per-token layer then runs on the
        plan's N tokens and attention within its segments. A plan of right-padded rows (made with
        ``computed``) gives the logits of its computed positions only, (N, V) in row-major order
        (``logits[computed]`` of the full forward: exact, as under causal attention a computed
        position never sees a later one); a plan of packed documents gives (B, T, V), each
        document's logits as it would get them alone (its RoPE positions restart at 0). Not with a
        ``cache``. ``rows`` (indices into those outputs, flattened) gives the logits of those rows
        only, (R, V): evaluation scores some positions and skips the lm_head for the others.
        With ``labels`` (one per output row, flattened; IGNORE_INDEX where there is no target):
        the summed fp32 cross-entropy instead of the logits, computed a chunk of tokens at a time
        (loss.py's `linear_token_loss_sum`), never the (tokens x V) logits whole. Inside the
        forward, so that every wrapper (DDP, FSDP, DataParallel) sees the lm_head used."""
        if plan is not None and cache is not None:
            raise ValueError(
                "an attention plan is for training and evaluation, not with a KV cache"
            )
        # Training's loss is a sum over tokens: its targets are put in the plan's order instead
        # of the hidden states in theirs (a pass over (N, C) forward and backward saved).
        ordered = plan is not None and labels is not None and rows is None
        x = self.base_model(input_ids, cache, plan, restore=not ordered)
        if rows is not None:
            x = x.flatten(0, -2)[rows]  # (R, C)
        if labels is not None:
            labels = plan.in_order(labels) if ordered else labels
            return linear_token_loss_sum(x, self.lm_head.weight, labels, backend=self.loss_backend)
        if rows is not None:
            return self.lm_head(x)  # (R, V)
        if plan is not None and not plan.subset:
            x = x.view(*input_ids.shape, -1)  # every position was computed: (N, C) -> (B, T, C)
        # Generation needs only the last position's logits: skip the lm_head for the others.
        return self.lm_head(x[:, -1:] if last_only else x)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.base_model.embed_tokens.weight.numel()
        return n


def init_std(config: LlamaConfig, name: str) -> float | None:
    """The std of weight ``name``'s Normal(0, std) initialization: 0.02, and for the residual
    output projections 0.02 / sqrt(2 * layers) (GPT-2), so the residual stream's variance does
    not grow with depth; None for a norm's weight, which starts at 1."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / math.sqrt(2 * config.num_hidden_layers)
    return 0.02


def initial_value(
    config: LlamaConfig, name: str, shape: torch.Size, generator: torch.Generator
) -> torch.Tensor:
    """The initial value of parameter or buffer ``name`` of ``shape`` (CPU, fp32): the rotary
    tables, or a weight as `init_std` says, drawn from ``generator``. Drawn whole, one tensor at
    a time in the model's order, so that each part of a sharded model gets its part of the values
    one process would draw, at any world size."""
    if name.startswith("base_model.rotary_emb."):
        cos, sin = rope_tables(config)
        return cos if name.endswith("cos") else sin
    std = init_std(config, name)
    if std is None:
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def flops_per_token(config: LlamaConfig, seq_length: int) -> int:
    """Training FLOPs per token (forward + backward), the PaLM/nanoGPT convention:
    6 x (matmul parameters) + 12 x layers x hidden x seq_length for attention scores and values.
    The embedding lookup is not a matmul; the lm_head is."""
    c, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_dim
    per_layer = 2 * c * c + 2 * c * kv + 3 * c * i
    matmul_params = n * per_layer + c * config.vocab_size
    return 6 * matmul_params + 12 * n * c * seq_length


def training_flops(config: LlamaConfig, lengths: torch.Tensor) -> int:
    """Training FLOPs of a batch whose tokens attend within spans of these lengths (see
    `segment_lengths`): each token its matmuls, ``flops_per_token(config, 0)``, and each span of
    L tokens 12 x layers x hidden x L^2 for attention, the convention of `flops_per_token` counted
    per document instead of per row. B rows of T tokens: B x T x flops_per_token(config, T)."""
    lengths = lengths.to(torch.int64)
    return span_flops(config, int(lengths.sum()), int((lengths * lengths).sum()))


def span_flops(config: LlamaConfig, tokens: int, squares: int) -> int:
    """`training_flops` from the spans' total length and sum of squared lengths."""
    attention = 12 * config.num_hidden_layers * config.hidden_size * squares
    return flops_per_token(config, 0) * tokens + attention
