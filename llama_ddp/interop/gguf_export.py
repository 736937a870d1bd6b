"""A model as one GGUF file, llama.cpp's format (llama-cli, llama-server, ollama and
llama-cpp-python read it), written so that llama.cpp runs it as it was trained: the same tokens,
the same logits. ``python -m llama_ddp.export MODEL --gguf OUT.gguf`` and ``train.py
--export-gguf`` write it; reading one back is files/gguf.py's.

Written with the ``gguf`` package that llama.cpp publishes (``GGUFWriter``, and ``gguf.quants``
for BF16 and Q8_0): ``pip install 'llama_ddp[gguf]'``. What goes in, as llama.cpp's own converter
(convert_hf_to_gguf.py) writes a Llama:

- the shape under ``llama.*`` (context length, RoPE theta and dimensions, RMSNorm eps, heads, KV
  heads, head size, vocabulary);
- the weights under llama.cpp's tensor names, the matrices in the chosen type, the norms in F32;
  Q and K rows permuted from the Hugging Face rotate-half pairing (ours) to llama.cpp's, which
  rotates adjacent pairs; a tied model stores its embedding once (no ``output.weight``);
- the tokenizer: byte-level BPE (``gpt2``) tokens, merges and token types (special tokens are
  CONTROL), the ids of our BOT/EOT/PAD roles as BOS/EOS/padding, BOS added to every prompt (each
  document was trained after a BOT) and no EOS, the chat template, and the pre-tokenizer label
  under which llama.cpp splits text as the tokenizer does (``tokenizer.ggml.pre``: llama.cpp
  knows pre-tokenizers by name, never by their regex).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llama_ddp.data.tokenizer_files import (
    SpecialIds,
    find_template,
    read_tokenizer,
    source_config,
    tokenizer_file,
)
from llama_ddp.errors import UserError
from llama_ddp.files import safe_io
from llama_ddp.files.gguf import INSTALL
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.weights import EMBEDDING, HEAD

GGUF_FILE = "model.gguf"  # what train.py --export-gguf writes into its out_dir


@dataclass(frozen=True)
class GgufType:
    """One choice of --type: how the matrices are stored (norms are F32 in every type)."""

    help: str
    file_type: str  # gguf.LlamaFileType's name: general.file_type
    matrix: str  # gguf.GGMLQuantizationType's name for the 2-D weights


GGUF_TYPES: dict[str, GgufType] = {
    "f32": GgufType("32-bit floats, the weights as trained", "ALL_F32", "F32"),
    "f16": GgufType("16-bit floats, half the size", "MOSTLY_F16", "F16"),
    "bf16": GgufType("bfloat16, half the size, fp32's range", "MOSTLY_BF16", "BF16"),
    "q8_0": GgufType(
        "8-bit integers and one scale per block of 32, about a quarter of f32 (a matrix whose "
        "rows are no multiple of 32 stays f16, as llama.cpp's converter leaves it)",
        "MOSTLY_Q8_0",
        "Q8_0",
    ),
}
DEFAULT_TYPE = "f32"

# The regexes with which byte-level BPE tokenizers split text before merging, and the names
# llama.cpp gives them (src/llama-vocab.cpp); GPT-2's is what ByteLevel(use_regex=True) applies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_LABELS = {_GPT2_SPLIT: "gpt-2", _LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}

# Our weight names (after base_model.layers.N.) -> llama.cpp's (after blk.N.).
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = re.compile(r"base_model\.layers\.(\d+)\.(.+)\.weight")


def _gguf() -> Any:
    """The gguf package, or one line saying how to install it."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"writing a GGUF file needs the gguf package ({INSTALL})")
    import gguf

    return gguf


def check_available() -> None:
    """A UserError unless the gguf package is installed (before a run that will export)."""
    _gguf()


def gguf_name(name: str) -> str | None:
    """llama.cpp's name of our weight ``name`` (None for the rotary tables, recomputed from the
    config by every loader)."""
    if name == EMBEDDING:
        return "token_embd.weight"
    if name == "base_model.norm.weight":
        return "output_norm.weight"
    if name == HEAD:
        return "output.weight"
    match = _LAYER.fullmatch(name)
    if match and match[2] in _LAYER_NAMES:
        return f"blk.{match[1]}.{_LAYER_NAMES[match[2]]}.weight"
    if name.startswith("base_model.rotary_emb."):
        return None
    raise UserError(f"weight {name} has no place in a llama.cpp Llama (is it a llama_ddp model?)")


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows from the Hugging Face RoPE pairing, which rotates dimension i with i + D/2 of
    each head, to llama.cpp's, which rotates 2i with 2i + 1: (heads, 2, D/2, in) -> (heads, D/2,
    2, in). The attention scores, and so the logits, are unchanged."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def pre_tokenizer_label(tokenizer_json: Mapping[str, Any], source: str | Path) -> str:
    """The name under which llama.cpp splits text as this byte-level BPE tokenizer does, or one
    UserError line saying what llama.cpp could not reproduce."""

    def refuse(what: str) -> UserError:
        return UserError(
            f"tokenizer {source}: {what}, which llama.cpp cannot reproduce (its byte-level BPE "
            f"knows the splits of GPT-2, Llama 3 and Qwen2 by name: "
            f"{', '.join(PRE_TOKENIZER_LABELS.values())}; train with one of ours, or export "
            "to Hugging Face with the hf/ folder instead)"
        )

    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = model.get("type") if not model.get("byte_fallback") else "BPE with byte fallback"
        raise refuse(f"its model is {kind}, not byte-level BPE")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise refuse("its BPE marks word pieces (continuing_subword_prefix/end_of_word_suffix)")
    if tokenizer_json.get("normalizer") is not None:
        raise refuse(f"it normalizes text ({tokenizer_json['normalizer'].get('type')})")
    if (tokenizer_json.get("decoder") or {}).get("type") != "ByteLevel":
        raise refuse("its decoder is not ByteLevel")
    pattern = _split_pattern(tokenizer_json.get("pre_tokenizer") or {})
    if pattern is None:
        raise refuse("its pre-tokenizer is not a byte-level split")
    if pattern not in PRE_TOKENIZER_LABELS:
        raise refuse(f"it splits text by the regex {pattern!r}")
    return PRE_TOKENIZER_LABELS[pattern]


def _split_pattern(pre: Mapping[str, Any]) -> str | None:
    """The one regex a byte-level pre-tokenizer splits text with, or None if it does anything
    else (adds a prefix space, splits digits, ...)."""
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return _GPT2_SPLIT
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    plain_bytes = (
        byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex", True)
    )
    isolated = (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and isinstance(split.get("pattern"), dict)
        and "Regex" in split["pattern"]
    )
    return split["pattern"]["Regex"] if plain_bytes and isolated else None


def gguf_pre_label(path: str | Path) -> str:
    """The pre-tokenizer label a GGUF file's tokenizer came with (llama.cpp's default when it
    names none), refused unless it is byte-level BPE."""
    gguf = _gguf()
    try:
        fields = gguf.GGUFReader(path).fields
    except (ValueError, OSError) as exc:
        raise UserError(f"tokenizer {path} is not a readable GGUF file ({exc})") from exc

    def text(key: str) -> str | None:
        field = fields.get(key)
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")

    if text("tokenizer.ggml.model") != "gpt2":
        raise UserError(
            f"tokenizer {path} is a {text('tokenizer.ggml.model')!r} tokenizer; llama_ddp "
            "writes byte-level BPE ('gpt2') GGUF files only (use the source GGUF as it is)"
        )
    return text("tokenizer.ggml.pre") or "default"


@dataclass(frozen=True)
class GgufTokenizer:
    """What the GGUF file says of the tokenizer."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    special: SpecialIds
    unk: int | None
    label: str
    chat_template: str | None


def read_gguf_tokenizer(
    path: str | Path, vocab_size: int, label: str | None = None
) -> GgufTokenizer:
    """The tokenizer.json at ``path`` (or in that folder) with its roles and chat template, as
    GGUF metadata for a model of ``vocab_size`` rows (ids without a token are UNUSED
    ``[PAD<id>]``, as llama.cpp's converter writes them); ``label`` is the pre-tokenizer's name
    when the tokenizer came from a GGUF file, else it is derived from the tokenizer."""
    gguf = _gguf()
    path = tokenizer_file(path)
    tok, special = read_tokenizer(path)
    data = json.loads(tok.to_str())
    label = label or pre_tokenizer_label(data, path)
    vocab = tok.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise UserError(
            f"tokenizer {path} has {len(vocab)} tokens (ids up to {max(vocab.values())}), more "
            f"than the model's {vocab_size} (give the tokenizer the model was trained with)"
        )
    added = tok.get_added_tokens_decoder()
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(
                gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    unk_token = data["model"].get("unk_token")
    try:
        template = find_template(path, source_config(path))
    except UserError:
        template = None  # no chat template: the file has none either
    return GgufTokenizer(
        tokens=tokens,
        types=[int(t) for t in types],
        merges=merges,
        special=special.ids,
        unk=vocab.get(unk_token) if unk_token is not None else None,
        label=label,
        chat_template=template,
    )


def check_tokenizer(path: str | Path) -> str:
    """The pre-tokenizer label of the tokenizer.json at ``path``, or a UserError now, before
    training, if llama.cpp cannot split text as it does (``--export-gguf`` would fail at the end
    of the run)."""
    _gguf()
    path = tokenizer_file(path)
    return pre_tokenizer_label(safe_io.read_json(path, "tokenizer"), path)


def _tensors(
    state: Mapping[str, torch.Tensor], config: LlamaConfig, kind: GgufType
) -> Iterator[tuple[str, np.ndarray, Any]]:
    """(llama.cpp's name, data, raw GGML type or None) for each weight to store."""
    gguf = _gguf()
    matrix = gguf.GGMLQuantizationType[kind.matrix]
    for name, tensor in state.items():
        key = gguf_name(name)
        if key is None or (key == "output.weight" and config.tie_word_embeddings):
            continue
        weight = tensor.detach().to("cpu", torch.float32)
        if key.endswith("attn_q.weight"):
            weight = rope_permute(weight, config.num_attention_heads)
        elif key.endswith("attn_k.weight"):
            weight = rope_permute(weight, config.num_key_value_heads)
        data = np.ascontiguousarray(weight.numpy())
        if data.ndim == 1 or matrix == gguf.GGMLQuantizationType.F32:
            yield key, data, None
            continue
        try:
            quantized = gguf.quants.quantize(data, matrix)
        except gguf.QuantError:  # rows no multiple of the block: F16, as llama.cpp does
            yield key, data.astype(np.float16), None
            continue
        yield key, quantized, (None if quantized.dtype == np.float16 else matrix)


def write_gguf(
    state: Mapping[str, torch.Tensor],
    config: LlamaConfig,
    tokenizer: GgufTokenizer,
    out: str | Path,
    type_name: str = DEFAULT_TYPE,
    name: str | None = None,
) -> Path:
    """Write the model (``state``: our names, fp32 or any float dtype; a tied model's lm_head is
    not stored) of shape ``config`` with ``tokenizer`` as the GGUF file ``out``, replaced whole:
    written under a temporary name beside it and renamed, never half-written."""
    gguf = _gguf()
    if type_name not in GGUF_TYPES:
        raise UserError(f"GGUF type {type_name!r} is not one of: {', '.join(GGUF_TYPES)}")
    kind, out = GGUF_TYPES[type_name], Path(out)
    tensors = list(_tensors(state, config, kind))
    needed = sum(data.nbytes for _, data, _ in tensors) + 64 * len(tokenizer.tokens)
    with safe_io.writing(out, "GGUF file", needed):
        out.parent.mkdir(parents=True, exist_ok=True)
        with safe_io.atomic_path(out) as tmp:
            writer = gguf.GGUFWriter(tmp, "llama")
            _add_metadata(writer, gguf, config, tokenizer, kind, name or out.stem)
            for key, data, raw in tensors:
                writer.add_tensor(key, data, raw_dtype=raw)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            safe_io.usual_mode(tmp)
    return out


def _add_metadata(
    w: Any, gguf: Any, c: LlamaConfig, tok: GgufTokenizer, kind: GgufType, name: str
) -> None:
    """The keys llama.cpp's llama architecture reads, as convert_hf_to_gguf.py writes them."""
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType[kind.file_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.label)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.special.bot)
    w.add_eos_token_id(tok.special.eot)
    w.add_pad_token_id(tok.special.pad)
    if tok.unk is not None:
        w.add_unk_token_id(tok.unk)
    w.add_add_bos_token(True)  # every document was trained after a BOT: so is every prompt
    w.add_add_eos_token(False)
    if tok.chat_template is not None:
        w.add_chat_template(tok.chat_template)


def export_gguf(
    state: Mapping[str, torch.Tensor],
    config: LlamaConfig,
    tokenizer_path: str | Path,
    out: str | Path,
    type_name: str = DEFAULT_TYPE,
    *,
    label: str | None = None,
    name: str | None = None,
) -> Path:
    """``write_gguf`` with the tokenizer at ``tokenizer_path`` (a tokenizer.json or its folder,
    with its roles); ``label`` is its pre-tokenizer's name when it came from a GGUF file."""
    tokenizer = read_gguf_tokenizer(tokenizer_path, config.vocab_size, label)
    return write_gguf(state, config, tokenizer, out, type_name, name)
