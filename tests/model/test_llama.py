"""model/llama.py: shapes and names, causality, RoPE, KV cache, initialization, the attention
plan."""

import math

import pytest
import torch
import torch.nn.functional as F

from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.model.config import LlamaConfig, preset
from llama_ddp.model.llama import (
    KVCache,
    LlamaForPretraining,
    apply_rope,
    flops_per_token,
    rope_tables,
    training_flops,
)


def tiny(**overrides) -> LlamaConfig:
    return preset("tiny", vocab_size=97, **overrides)


def test_logits_shape_and_dtype():
    model = LlamaForPretraining(tiny())
    ids = torch.randint(0, 97, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, 97)
    assert logits.dtype == torch.float32


def test_state_dict_keys_are_the_design_names():
    config = tiny(num_hidden_layers=1)
    keys = list(LlamaForPretraining(config).state_dict())
    layer = "base_model.layers.0."
    assert keys == [
        "base_model.rotary_emb.cos",
        "base_model.rotary_emb.sin",
        "base_model.embed_tokens.weight",
        layer + "input_layernorm.weight",
        layer + "self_attn.q_proj.weight",
        layer + "self_attn.k_proj.weight",
        layer + "self_attn.v_proj.weight",
        layer + "self_attn.o_proj.weight",
        layer + "post_attention_layernorm.weight",
        layer + "mlp.gate_proj.weight",
        layer + "mlp.up_proj.weight",
        layer + "mlp.down_proj.weight",
        "base_model.norm.weight",
        "lm_head.weight",
    ]
    state = LlamaForPretraining(config).state_dict()
    d = config.head_dim
    assert state["base_model.rotary_emb.cos"].shape == (config.max_position_embeddings, d)
    assert state[layer + "self_attn.k_proj.weight"].shape == (
        config.num_key_value_heads * d,
        config.hidden_size,
    )


def test_no_biases_and_untied_embeddings():
    model = LlamaForPretraining(tiny())
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.lm_head.weight.data_ptr() != model.base_model.embed_tokens.weight.data_ptr()


def test_causality_changing_a_token_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny()).eval()
    ids = torch.randint(0, 97, (2, 20))
    base = model(ids)
    for t in (0, 7, 19):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 97
        out = model(changed)
        # exact: the same shapes and kernels, and a masked key adds an exact 0
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-6


def test_gqa_with_kv_heads_equal_to_heads_is_plain_multi_head_attention():
    torch.manual_seed(0)
    config = tiny(num_key_value_heads=4)
    model = LlamaForPretraining(config).eval()
    attn = model.base_model.layers[0].self_attn
    x = torch.randn(2, 9, config.hidden_size)
    cos, sin = model.base_model.rotary_emb(0, 9)

    def heads(t):
        return t.view(2, 9, 4, config.head_dim).transpose(1, 2)

    q = apply_rope(heads(attn.q_proj(x)), cos, sin)
    k = apply_rope(heads(attn.k_proj(x)), cos, sin)
    v = heads(attn.v_proj(x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(config.head_dim)
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, -1))
    torch.testing.assert_close(attn(x, (cos, sin)), expected, rtol=1e-5, atol=1e-6)


def test_gqa_equals_attention_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = tiny()  # 4 heads, 2 KV heads
    mha = tiny(num_key_value_heads=4)
    a, b = LlamaForPretraining(gqa).eval(), LlamaForPretraining(mha).eval()
    state = a.state_dict()
    for i in range(gqa.num_hidden_layers):
        for name in ("k_proj", "v_proj"):
            key = f"base_model.layers.{i}.self_attn.{name}.weight"
            w = state[key].view(gqa.num_key_value_heads, gqa.head_dim, -1)
            state[key] = w.repeat_interleave(2, dim=0).reshape(-1, gqa.hidden_size)
    b.load_state_dict(state)
    ids = torch.randint(0, 97, (2, 13))
    torch.testing.assert_close(a(ids), b(ids), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    config = tiny()
    cos, sin = rope_tables(config)
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1, config.head_dim)
    k = torch.randn(1, 1, 1, config.head_dim)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return float((qm * kn).sum())

    assert score(5, 2) == pytest.approx(score(105, 102), abs=1e-4)
    assert score(40, 40) == pytest.approx(score(0, 0), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    # Rotation preserves norms.
    rotated = apply_rope(q, cos[77:78], sin[77:78])
    assert float(rotated.norm()) == pytest.approx(float(q.norm()), rel=1e-5)


def test_rope_tables_match_the_formula():
    config = tiny()
    cos, sin = rope_tables(config)
    d = config.head_dim
    pos, i = 37, 3
    angle = pos / config.rope_theta ** (2 * i / d)
    assert float(cos[pos, i]) == pytest.approx(math.cos(angle), abs=1e-6)
    assert float(sin[pos, i + d // 2]) == pytest.approx(math.sin(angle), abs=1e-6)


def test_kv_cache_prefill_and_steps_match_full_forward():
    torch.manual_seed(0)
    config = tiny()
    model = LlamaForPretraining(config).eval()
    ids = torch.randint(0, 97, (2, 16))
    full = model(ids)
    cache = KVCache(config, batch_size=2, max_length=32)
    parts = [model(ids[:, :5], cache), model(ids[:, 5:9], cache)]
    parts += [model(ids[:, t : t + 1], cache) for t in range(9, 16)]
    assert cache.position == 16
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_positions_is_refused():
    config = tiny(max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LlamaForPretraining(config)(torch.zeros(1, 17, dtype=torch.long))


def test_initialization_std_and_scaled_output_projections():
    torch.manual_seed(0)
    config = preset("small", vocab_size=4096)
    model = LlamaForPretraining(config)
    std = model.base_model.layers[0].mlp.up_proj.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.02)
    scaled = model.base_model.layers[0].self_attn.o_proj.weight.std().item()
    assert scaled == pytest.approx(0.02 / math.sqrt(2 * config.num_hidden_layers), rel=0.02)
    assert torch.equal(model.base_model.norm.weight, torch.ones(config.hidden_size))


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny())
    ids = torch.randint(0, 97, (4, 32))
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert loss.item() == pytest.approx(math.log(97), rel=0.05)


def test_parameter_count_and_flops():
    config = tiny()
    model = LlamaForPretraining(config)
    c, i, kv, v = 64, 176, 2 * 16, 97
    per_layer = 2 * c * c + 2 * c * kv + 3 * c * i + 2 * c
    assert model.num_parameters() == 2 * v * c + 2 * per_layer + c
    assert model.num_parameters(exclude_embeddings=True) == v * c + 2 * per_layer + c
    matmul = 2 * (2 * c * c + 2 * c * kv + 3 * c * i) + c * v
    assert flops_per_token(config, 128) == 6 * matmul + 12 * 2 * c * 128


def test_last_only_gives_the_last_positions_logits():
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny()).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:])


def test_real_positions_give_the_full_forwards_logits_and_gradients():
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny())
    x = torch.randint(0, 97, (4, 24))
    real = torch.arange(24) < torch.tensor([[5], [24], [1], [17]])  # right-padded row prefixes
    full = model(x)
    part = model(x, plan=plan_attention(x.shape, real))
    assert part.shape == (5 + 24 + 1 + 17, 97)
    torch.testing.assert_close(part, full[real], rtol=0, atol=1e-6)
    weights = torch.randn(part.shape)
    grads_full = torch.autograd.grad((full[real] * weights).sum(), list(model.parameters()))
    grads_part = torch.autograd.grad((part * weights).sum(), list(model.parameters()))
    # The two paths sum a gradient's rows in other orders (and MKL's kernels differ by CPU: an
    # AVX2 path gave 5.7e-6 on lm_head, whose largest entry is ~25): 1e-6 of each tensor's
    # largest entry, ~8 fp32 ulps of it; a leaked or lost position differs by its whole share.
    for a, b in zip(grads_full, grads_part):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * max(1.0, a.abs().max().item()))


# --- packed documents (issue 13) ----------------------------------------------------------------


def documents(lengths_by_row: list[list[int]]) -> torch.Tensor:
    """(B, T) document ids, non-decreasing along each row, from each row's document lengths."""
    return torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
            for row in lengths_by_row
        ]
    )


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "real"])
def test_each_document_gets_the_logits_and_gradients_it_gets_alone(padded):
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny())  # 4 heads, 2 KV heads: grouped-query attention
    rows = [[5, 20, 15], [40], [1, 18, 3, 18], [9, 31]]  # segments of different widths per row
    ids = documents(rows) + torch.tensor([[0], [3], [7], [2]])  # any non-decreasing numbers
    x = torch.randint(0, 97, (4, 40))
    real = torch.arange(40) < torch.tensor([[40], [33], [22], [9]]) if padded else None
    packed = model(x, plan=plan_attention(x.shape, real, ids))
    # The reference: every document (clipped to its row's real prefix) run alone, in order.
    alone = []
    for r, row in enumerate(rows):
        n = int(real[r].sum()) if padded else 40
        ends = torch.tensor(row).cumsum(0).clamp(max=n).tolist()
        for start, end in zip([0, *ends[:-1]], ends):
            if end > start:
                alone.append(model(x[r : r + 1, start:end])[0])
    expected = torch.cat(alone)
    assert packed.shape == ((40 + 33 + 22 + 9, 97) if padded else (4, 40, 97))
    got = packed if padded else packed.flatten(0, 1)  # every position, row-major
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    weights = torch.randn(expected.shape)
    grads_alone = torch.autograd.grad((expected * weights).sum(), list(model.parameters()))
    grads_packed = torch.autograd.grad((got * weights).sum(), list(model.parameters()))
    for a, b in zip(grads_alone, grads_packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_no_plan_is_the_plain_path_and_one_document_per_row_matches_it():
    torch.manual_seed(0)
    model = LlamaForPretraining(tiny()).eval()
    x = torch.randint(0, 97, (3, 24))
    real = torch.arange(24) < torch.tensor([[24], [7], [16]])
    with torch.no_grad():
        plain, part = model(x), model(x, plan=plan_attention(x.shape, real))
        assert torch.equal(model(x, plan=None), plain)  # bit for bit: the same path
        one = torch.zeros(3, 24, dtype=torch.long)  # one document per row: the rows' own layout
        whole = model(x, plan=plan_attention(x.shape, document_ids=one))
        torch.testing.assert_close(whole, plain, rtol=0, atol=1e-5)
        both = model(x, plan=plan_attention(x.shape, real, one))
        torch.testing.assert_close(both, part, rtol=0, atol=1e-5)


def test_document_ids_are_checked():
    model = LlamaForPretraining(tiny())
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_attention(x.shape, document_ids=torch.tensor([[0, 1, 0, 1]]))
    plan = plan_attention(x.shape, document_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="not with a KV cache"):
        model(x, KVCache(tiny(), 1, 8), plan=plan)


def test_training_flops_count_attention_per_document():
    config = tiny()
    c, n = 64, 2
    dense = flops_per_token(config, 0)
    assert training_flops(config, torch.tensor([128, 128])) == 2 * 128 * flops_per_token(
        config, 128
    )
    assert training_flops(config, torch.tensor([100, 28])) == 128 * dense + 12 * n * c * (
        100**2 + 28**2
    )
    assert training_flops(config, torch.tensor([], dtype=torch.long)) == 0
