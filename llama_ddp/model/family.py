"""The model family: one size knob, the depth, from which every other dimension follows (as
nanochat derives its width from its depth), beside the presets (model/config.py), which stay as
they are.

A member of depth ``d`` (``--model-size d``):
- ``d`` decoder layers, width (hidden size) 64 x d: the aspect ratio of ``small`` (256 wide, 4
  layers) and ``base`` (768, 12), whose widths members 4 and 12 share;
- heads of 64 (d heads, base's head size), KV heads the largest divisor of the heads not above a
  quarter of them, at least one (base's 12 / 3 and small's 8 / 2 ratio; one below 8 heads);
- the SwiGLU MLP 8/3 of the width rounded up to a multiple of 64 (the parameters of a 4 x MLP
  without the gate, Llama's rule; small's 704 is this rule's at 256);
- 2048 positions (base's), RoPE theta 10000, untied embeddings, as the presets.

Every member is a Llama of the same module names, so export (Hugging Face, GGUF) is unchanged.
The learning rate that goes with a member is its optimizer's default peak lr (tuned on
``small``, width 256) times `lr_scale`: 256 / width, the same factor for Muon's part (whose
updates torch's match_rms_adamw scales to AdamW's RMS) and AdamW's (embedding, lm_head, norms):
muP's 1/width for the hidden matrices under Adam. A sweep on the CPU chose it over nanochat's
1/sqrt(width) (`python bench/bench_size.py lr`, BENCHMARKS.md): at width 64 the best of 4e-3,
8e-3 and 1.6e-2 was 1.6e-2, at 128 the best lies near 7e-3 (of 2.8e-3, 5.7e-3, 1.1e-2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from llama_ddp.errors import UserError

WIDTH_PER_LAYER = 64  # hidden size per decoder layer: the aspect ratio
HEAD_DIM = 64
POSITIONS = 2048
LR_WIDTH = 256  # the width the optimizers' default learning rates were tuned at (small's)
MAX_DEPTH = 64  # 4,096 wide: 11.56B parameters at a 32,768 vocabulary (11.29B non-embedding)
# The fields the rule derives from the depth (a shape flag may still override one of a member
# given by its depth; --model-size auto, which chooses the depth, takes none of them)
DERIVED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def kv_heads(heads: int) -> int:
    """The largest divisor of ``heads`` not above a quarter of them (at least 1)."""
    return max(k for k in range(1, max(1, heads // 4) + 1) if heads % k == 0)


def member_shape(depth: int) -> dict[str, int]:
    """The shape fields (LlamaConfig's names) of the family's member of ``depth`` layers."""
    if not 1 <= depth <= MAX_DEPTH:
        raise UserError(
            f"--model-size {depth} is not a depth from 1 to {MAX_DEPTH} (give one, or auto with "
            "--time-budget)"
        )
    width = WIDTH_PER_LAYER * depth
    heads = width // HEAD_DIM
    return dict(
        hidden_size=width,
        intermediate_size=64 * math.ceil(8 * width / 3 / 64),
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads(heads),
        max_position_embeddings=POSITIONS,
    )


def lr_scale(width: int) -> float:
    """The factor of the optimizer's default peak lr for a member ``width`` wide: LR_WIDTH /
    width (1 at small's width, 4 at 64, 1/3 at base's 768)."""
    return LR_WIDTH / width


def depth_of(config: Mapping[str, Any]) -> int | None:
    """The depth of the member a model config (LlamaConfig's fields, as a dict) is (its
    vocabulary, tying and RoPE aside), else None."""
    depth = config.get("num_hidden_layers", 0)
    if not 1 <= depth <= MAX_DEPTH:
        return None
    shape = member_shape(depth)
    return depth if all(config.get(k) == v for k, v in shape.items()) else None
