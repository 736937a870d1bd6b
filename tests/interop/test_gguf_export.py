"""gguf_export.py and `python -m llama_ddp.export --gguf`: a model as llama.cpp's GGUF file, read
back by our GGUF reader (transformers') with the same logits and the same tokens, refused in one
line where llama.cpp could not run it as trained; llama.cpp itself where llama-cpp-python is
installed."""

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import read_tokenizer, save_tokenizer
from llama_ddp.errors import UserError
from llama_ddp.export import main as export_main
from llama_ddp.files.gguf import write_tokenizer_folder
from llama_ddp.interop.gguf_export import (
    GGUF_TYPES,
    export_gguf,
    pre_tokenizer_label,
    rope_permute,
)
from llama_ddp.interop.load import load_model
from llama_ddp.interop.native import run_summary, save_model
from llama_ddp.model.config import member
from llama_ddp.model.llama import LlamaForPretraining
from tests.helpers.runs import CHAT_TEMPLATE, tiny, tiny_args, train_here
from tests.helpers.ties import TIE, assert_greedy_agrees, tie_gap

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

# Text that tokenizers split differently when their pre-tokenizers differ in any detail.
AWKWARD = [
    "def f(x):\r\n\treturn x  *  2   # ok\n\n\n",
    "héllo wörld, Zwölf Boxkämpfer 日本語のテキスト ",
    "🦙🦙 🚀 (emoji) 😶\u200d🌫️ ✅",
    "1 12 123 1234 12345 3.14159 0xFF 1e-5",
    "    leading spaces\t\t\ttabs \t mixed \n  \n",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "[BOT] [EOT] [PAD] typed as text",
    "x=[i**2 for i in range(10)]; print(f'{x!r:>10}')",
]
# Unit roundoff of each type's matrices (Q8_0: half a step of 127 levels of its block's
# largest weight). Rounding every weight by at most u of its size moves the logits of these
# 2-layer models by about u times their largest value (measured on random tiny models: 0.7u for
# f16, 0.8u for bf16, 2.2-3u for q8_0); 8u bounds that with room, while a wrong RoPE pairing
# moves `sharp`'s logits by 0.45 of their size (115u of q8_0).
ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8, "q8_0": 1 / 254}


def fields(path):
    """The GGUF file's metadata (strings, numbers, lists) and its tensors' types by name."""
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items()}
    return meta, {t.name: t.tensor_type.name for t in reader.tensors}


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


def sharp(vocab_size: int, **overrides):
    """A tiny model whose attention depends on Q and K: at initialization their scores are near 0
    and attention near uniform, so a wrong RoPE pairing would change the logits too little to
    see (Q, K x 8: it moves them by 45% of their size; lm_head x 4: logits of order 1)."""
    model = tiny(vocab_size, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
        model.lm_head.weight.mul_(4)
    return model


@pytest.fixture(scope="module")
def out(tok, tmp_path_factory):
    """A saved run folder: llama_model.pth (+ .json) of `sharp`, tokenizer.json with its
    tokenizer_config.json."""
    out = tmp_path_factory.mktemp("gguf") / "out"
    save_tokenizer(tok, out.parent / "tokenizer.json")
    model = sharp(tok.get_vocab_size())
    save_model(model, model.config, out, out.parent / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def batch():
    return torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_the_gguf_file_reads_back_with_the_same_logits(out, tmp_path, batch, kind, one_thread):
    """out/ (a tiny untied model, our tokenizer) -> GGUF -> our reader: f32 is the model itself,
    bit for bit; the others within 8 times their roundoff (see ROUNDOFF), and not equal."""
    model = load_model(out)
    back = load_model(export_gguf(model.state_dict(), model.config, out, tmp_path / "m.gguf", kind))
    # GGUF stores the RMSNorm eps as float32: 1e-5 comes back as float32(1e-5)
    eps = float(np.float32(model.config.rms_norm_eps))
    assert back.config == dataclasses.replace(model.config, rms_norm_eps=eps)
    ours, theirs = logits(model, batch), logits(back, batch)
    if kind == "f32":
        assert torch.equal(ours, theirs)  # the same weights through the same kernels
    else:
        diff = (ours - theirs).abs().max().item()
        assert 0 < diff <= 8 * ROUNDOFF[kind] * ours.abs().max().item()


def test_the_file_carries_llama_cpps_keys_names_and_types(out, tmp_path):
    """What llama.cpp's llama architecture reads: its shape, our roles as BOS/EOS/padding (the
    role tokens CONTROL), BOS added and EOS not, the gpt-2 split; matrices Q8_0 but ffn_down
    (176 columns, no multiple of 32: F16, as llama.cpp's converter leaves it), norms F32."""
    model = load_model(out)
    c = model.config
    meta, types = fields(export_gguf(model.state_dict(), c, out, tmp_path / "m.gguf", "q8_0"))
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    shape = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": c.head_dim,
        "rope.dimension_count": c.head_dim,
        "rope.freq_base": c.rope_theta,
        "vocab_size": c.vocab_size,
    }
    assert {k: meta[f"llama.{k}"] for k in shape} == shape
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5, rel=1e-7)
    tok, special = read_tokenizer(out)
    vocab = tok.get_vocab(with_added_tokens=True)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    control = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3]
    assert control == [0, 1, 2] == [vocab["[BOT]"], vocab["[EOT]"], vocab["[PAD]"]]
    assert set(meta["tokenizer.ggml.token_type"][3:]) == {1}  # NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding")]
    assert ids == [special.ids.bot, special.ids.eot, special.ids.pad]
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    assert "tokenizer.chat_template" not in meta  # ours has none
    assert types.pop("blk.0.ffn_down.weight") == types.pop("blk.1.ffn_down.weight") == "F16"
    norms = {n for n in types if n.endswith("norm.weight")}
    assert {types[n] for n in norms} == {"F32"} and len(norms) == 5
    assert {types[n] for n in set(types) - norms} == {"Q8_0"} and "output.weight" in types


def test_q_and_k_are_permuted_to_llama_cpps_rope_pairs(one_thread):
    """llama.cpp's llama architecture rotates dimensions (2i, 2i+1) of each head; ours and
    Hugging Face's (i, i + D/2). The permuted weights under the adjacent-pair rotation give the
    attention scores that ours give under rotate-half."""
    torch.manual_seed(0)
    heads, head_dim, hidden, seq = 4, 16, 64, 7
    x = torch.randn(seq, hidden)
    wq = torch.randn(heads * head_dim, hidden)
    freqs = torch.outer(torch.arange(seq).float(), 1e4 ** (-torch.arange(0, head_dim, 2) / 16))
    cos, sin = freqs.cos(), freqs.sin()  # (seq, D/2)

    def rotate_half(q):  # ours: pair i with i + D/2
        a, b = q[..., : head_dim // 2], q[..., head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rotate_pairs(q):  # llama.cpp's: pair 2i with 2i + 1
        a, b = q[..., 0::2], q[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

    def scores(w, rotate):
        q = rotate((x @ w.T).view(seq, heads, head_dim).transpose(0, 1))  # (heads, seq, D)
        return q @ q.transpose(1, 2)

    ours = scores(wq, rotate_half)
    assert torch.allclose(scores(rope_permute(wq, heads), rotate_pairs), ours, atol=1e-3)
    assert not torch.allclose(scores(wq, rotate_pairs), ours, atol=1)  # unpermuted: wrong


def test_a_tied_model_stores_its_embedding_once(tok, tmp_path, batch, one_thread):
    tok_path = tmp_path / "tokenizer.json"
    save_tokenizer(tok, tok_path)
    model = tiny(tok.get_vocab_size(), tie_word_embeddings=True)
    path = export_gguf(model.state_dict(), model.config, tok_path, tmp_path / "tied.gguf")
    _, types = fields(path)
    assert "token_embd.weight" in types and "output.weight" not in types
    back = load_model(path)
    assert (
        back.config.tie_word_embeddings
        and back.lm_head.weight is back.base_model.embed_tokens.weight
    )
    assert torch.equal(logits(back, batch), logits(model, batch))


@pytest.mark.parametrize("depth", [1, 3])
def test_a_member_of_the_family_reads_back_with_the_same_logits(
    tok, tmp_path, batch, depth, one_thread
):
    """--model-size's members (one head and MQA at 1; three heads of 64 at 3) through GGUF,
    f32: the model itself, bit for bit."""
    tok_path = tmp_path / "tokenizer.json"
    save_tokenizer(tok, tok_path)
    torch.manual_seed(depth)
    config = member(depth, vocab_size=tok.get_vocab_size(), max_position_embeddings=64)
    model = LlamaForPretraining(config).eval()
    back = load_model(export_gguf(model.state_dict(), config, tok_path, tmp_path / "m.gguf"))
    assert back.config == dataclasses.replace(config, rms_norm_eps=float(np.float32(1e-5)))
    assert torch.equal(logits(back, batch), logits(model, batch))


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "in-the-run-folder"])
def test_the_files_tokenizer_splits_awkward_text_as_ours(out, tmp_path, beside):
    """Our tokenizer and the GGUF's vocabulary as transformers reads it back give the same ids
    and the same roles; also for OUT/model.gguf beside the run's tokenizer_config.json (which
    transformers would otherwise read instead of the file's BOS and EOS)."""
    folder = tmp_path / "run"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("hf"))
    where = folder if beside else tmp_path / "alone"
    model = load_model(folder)
    path = export_gguf(model.state_dict(), model.config, folder, where / "model.gguf")
    back, back_special = read_tokenizer(write_tokenizer_folder(path, tmp_path / "back"))
    ours, special = read_tokenizer(folder)
    assert back_special == special
    # the file's vocabulary, no more: transformers' converter adds a GPT-2 <|endoftext|>
    assert back.get_vocab_size() == ours.get_vocab_size()
    theirs, mine = text_encoder(back), text_encoder(ours)
    for text in AWKWARD:
        ids = mine.encode(text, add_special_tokens=False).ids
        assert theirs.encode(text, add_special_tokens=False).ids == ids, text
        assert ours.decode(ids) == text


def _tokenizer_json(pre, normalizer=None, model=None):
    tok = Tokenizer(model or models.BPE())
    tok.pre_tokenizer, tok.decoder, tok.normalizer = pre, decoders.ByteLevel(), normalizer
    return json.loads(tok.to_str())


LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # Meta-Llama-3's tokenizer.json


def _split(regex):
    from tokenizers import Regex

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def test_the_pre_tokenizer_label_is_the_name_llama_cpp_splits_it_by(tok):
    assert pre_tokenizer_label(json.loads(tok.to_str()), "ours") == "gpt-2"
    assert pre_tokenizer_label(_tokenizer_json(_split(LLAMA3)), "llama3") == "llama-bpe"
    qwen2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
    assert pre_tokenizer_label(_tokenizer_json(_split(qwen2)), "qwen2") == "qwen2"


@pytest.mark.parametrize(
    "data, why",
    [
        (_tokenizer_json(pre_tokenizers.ByteLevel(add_prefix_space=True)), "not a byte-level"),
        (_tokenizer_json(_split(r"\w+|\s+")), r"splits text by the regex '\\w+|\\s+'"),
        (
            _tokenizer_json(
                pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel()]
                )
            ),
            "not a byte-level split",
        ),
        (
            _tokenizer_json(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC()),
            "it normalizes text (NFC)",
        ),
        (_tokenizer_json(pre_tokenizers.Metaspace(), model=models.Unigram()), "is Unigram"),
        (_tokenizer_json(pre_tokenizers.Whitespace(), model=models.WordPiece()), "is WordPiece"),
    ],
    ids=["prefix-space", "other-regex", "digits", "normalizer", "unigram", "wordpiece"],
)
def test_a_tokenizer_llama_cpp_cannot_reproduce_is_refused(data, why):
    with pytest.raises(UserError, match="llama.cpp cannot reproduce") as err:
        pre_tokenizer_label(data, "t.json")
    assert why in str(err.value) and "\n" not in str(err.value)


def test_a_chat_models_template_unk_and_roles_go_in(chat_model, tmp_path, batch):
    """A Hugging Face folder (tied, rope_theta 5e5, a chat template, an unk token, BOS
    <|im_start|>, EOS <|im_end|>, pad <|endoftext|>) through the command: its template and ids
    in the file, its logits back."""
    source, path = chat_model["source"], tmp_path / "chat.gguf"
    assert export_main([str(source), "--gguf", str(path)]) == 0
    meta, types = fields(path)
    tok, special = read_tokenizer(source)
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert meta["general.name"] == "source"  # the model's folder
    assert meta["tokenizer.ggml.unknown_token_id"] == tok.token_to_id("<unk>")
    ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding")]
    assert ids == [tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    assert meta["llama.rope.freq_base"] == 5e5 and "output.weight" not in types
    ids = batch % tok.get_vocab_size()
    assert torch.equal(logits(load_model(path), ids), logits(load_model(source), ids))


def test_a_gguf_source_keeps_its_pre_tokenizer_label(chat_model, tmp_path, batch):
    """The chat model's Q8_0 GGUF (labelled "default" by its writer) re-exported as f32: the
    label it came with, and the weights as dequantized."""
    path = tmp_path / "again.gguf"
    assert export_main([str(chat_model["gguf"]), "--gguf", str(path)]) == 0
    meta, _ = fields(path)
    assert meta["tokenizer.ggml.pre"] == "default"
    assert meta["general.name"] == "tiny-chat-q8"  # the source file's
    source = load_model(chat_model["gguf"])
    assert torch.equal(logits(load_model(path), batch % 300), logits(source, batch % 300))


def test_the_command_refuses_to_overwrite_unless_forced(out, tmp_path, capsys):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"keep me")
    assert export_main([str(out), "--gguf", str(path)]) == 2
    assert capsys.readouterr().err == f"error: --gguf {path} exists (pass --force to replace it)\n"
    assert path.read_bytes() == b"keep me"
    assert export_main([str(out), "--gguf", str(path), "--force", "--type", "f16"]) == 0
    assert f"wrote {path} (f16, " in capsys.readouterr().out
    assert fields(path)[0]["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(out, tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"keep me")

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    assert export_main([str(out), "--gguf", str(path), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write GGUF file {path}: No space left on device; ")
    assert err.count("\n") == 1 and path.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def _unlabelled(out, folder):
    """out/ with a tokenizer that adds a prefix space, which llama.cpp's gpt2 vocabulary never
    does."""
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("hf"))
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"]["add_prefix_space"] = True
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize(
    "case, message",
    [
        ("type", "error: argument --type: invalid choice: 'q4_0' (choose from 'f32', 'f16', "),
        ("empty-folder", "error: {tmp}/empty holds no model: no llama_model.pth, config.json or"),
        ("text-file", "error: model config {tmp}/llama_model.json not found"),
        ("folder-out", "error: --gguf {tmp} is a folder"),
        ("unlabelled", "error: tokenizer {tmp}/prefix/tokenizer.json: its pre-tokenizer is not a"),
        ("no-tokenizer", "error: no tokenizer.json in {tmp}/bare (pass --tokenizer"),
        ("no-gguf", "error: writing a GGUF file needs the gguf package (pip install "),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    out, tmp_path, capsys, monkeypatch, case, message
):
    target, args = tmp_path / "m.gguf", []
    model = str(out)
    if case == "type":
        args = ["--type", "q4_0"]
    elif case == "empty-folder":
        model = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
    elif case == "text-file":
        model = str(tmp_path / "notes.txt")
        (tmp_path / "notes.txt").write_text("not a model")
    elif case == "folder-out":
        target = tmp_path
    elif case == "unlabelled":
        model = str(_unlabelled(out, tmp_path / "prefix"))
    elif case == "no-tokenizer":
        model = str(tmp_path / "bare")
        shutil.copytree(out, tmp_path / "bare", ignore=shutil.ignore_patterns("hf", "tok*"))
    elif case == "no-gguf":
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else find_spec(n, *a)
        )
    before = sorted(tmp_path.rglob("*"))
    assert export_main([model, "--gguf", str(target), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before


def test_a_tokenizer_larger_than_the_model_is_refused(out, tok, tmp_path, capsys):
    big = tmp_path / "big"
    save_tokenizer(tok, big / "tokenizer.json")
    small = tiny(300)
    path = tmp_path / "small.gguf"
    with pytest.raises(UserError, match="has 320 tokens .* more than the model's 300"):
        export_gguf(small.state_dict(), small.config, big, path)
    assert not path.exists()


def test_the_end_of_a_run_names_the_gguf_file():
    lines = run_summary(Path("a"), None, hf=False, gguf=True).splitlines()
    assert "      a/model.gguf (for llama.cpp and ollama)" in lines
    assert lines[-1] == "  llama-cli -m a/model.gguf"


@pytest.mark.e2e
def test_train_py_export_gguf_writes_the_trained_model(train_env, tmp_path, batch):
    out = tmp_path / "out"
    result = train_here(train_env, tiny_args(train_env, out, "--export-gguf", "--max-steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{out / 'model.gguf'} (for llama.cpp and ollama)" in result.stdout
    ids = batch % 300
    assert torch.equal(logits(load_model(out / "model.gguf"), ids), logits(load_model(out), ids))
    assert fields(out / "model.gguf")[0]["general.name"] == "out"


@pytest.mark.e2e
def test_train_py_refuses_a_tokenizer_llama_cpp_cannot_split_before_training(train_env, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    data = json.loads(train_env["tokenizer"].read_text())
    data["pre_tokenizer"]["add_prefix_space"] = True
    (folder / "tokenizer.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    args = tiny_args(train_env, out, "--export-gguf", "q8_0", "--tokenizer", str(folder))
    result = train_here(train_env, args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: tokenizer {folder / 'tokenizer.json'}: its pre-")
    assert "llama.cpp cannot reproduce" in result.stderr and result.stderr.count("\n") == 1
    assert not (out / "metrics.jsonl").exists() or "step" not in (out / "metrics.jsonl").read_text()
    assert not (out / "llama_model.pth").exists()


# --- llama.cpp itself (llama-cpp-python: pip install 'llama_ddp[llamacpp]'; skipped without it) ---
@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def _llama(llama_cpp, path, **kw):
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_batch=256, n_threads=1, verbose=False, **kw
    )


def _llama_logits(llm, ids):
    """llama.cpp's logits at every position of ``ids``, (len(ids), vocab)."""
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def _prompts(out):
    """BOT + each awkward text, as our generate frames a prompt."""
    tok, special = read_tokenizer(out)
    encoder = text_encoder(tok)
    return [[special.ids.bot, *encoder.encode(t, add_special_tokens=False).ids] for t in AWKWARD]


@pytest.fixture(scope="module")
def gguf_files(out, tmp_path_factory):
    model, folder = load_model(out), tmp_path_factory.mktemp("llama_cpp")
    return {
        kind: export_gguf(model.state_dict(), model.config, out, folder / f"{kind}.gguf", kind)
        for kind in ("f32", "q8_0")
    }


def test_llama_cpp_splits_text_as_we_do(llama_cpp, out, gguf_files):
    """Its tokens, without and with the BOS it adds (our BOT), and its text back."""
    llm = _llama(llama_cpp, gguf_files["f32"], vocab_only=True)
    for text, ids in zip(AWKWARD, _prompts(out)):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids[1:], text
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ids, text
        assert llm.detokenize(ids[1:]).decode() == text


@pytest.mark.parametrize("label", ["llama-bpe", "qwen2"])
def test_llama_cpp_splits_a_hugging_face_split_under_its_label(llama_cpp, tmp_path, label):
    """A byte-level BPE trained with Llama 3's (or Qwen2's) split regex, as a Hugging Face
    tokenizer.json holds it: the label derived from the regex makes llama.cpp split as it does
    (labelled gpt-2 instead, 5 of the 8 texts split otherwise)."""
    from tokenizers import trainers

    regex = LLAMA3 if label == "llama-bpe" else LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = _split(regex), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["[BOT]", "[EOT]", "[PAD]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(AWKWARD * 4, trainer)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    model = tiny(tok.get_vocab_size())
    path = export_gguf(model.state_dict(), model.config, tmp_path, tmp_path / "m.gguf")
    assert fields(path)[0]["tokenizer.ggml.pre"] == label
    llm, encoder = _llama(llama_cpp, path, vocab_only=True), text_encoder(tok)
    for text in AWKWARD:
        ids = encoder.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text


def test_llama_cpp_computes_our_logits_and_greedy_tokens(llama_cpp, out, gguf_files, one_thread):
    """f32: with llama.cpp's key/value cache in f32 too, every logit within 1e-5 of ours (both
    compute in fp32, the sums in other orders: measured 1.2e-6), the same argmax at every
    position and the same 24 greedy tokens after each prompt, unless our two best logits tie
    within twice that 1e-5 (two implementations, each dispatching by the CPU's ISA, may then pick
    either); with its default f16 cache, which rounds keys and values, within 1e-3 (measured
    6.5e-4)."""
    from llama_ddp.generation.generate import generate

    model = load_model(out)
    f32 = _llama(llama_cpp, gguf_files["f32"], logits_all=True, type_k=0, type_v=0)  # GGML F32
    f16 = _llama(llama_cpp, gguf_files["f32"], logits_all=True)
    for ids in _prompts(out):
        ours, theirs = logits(model, torch.tensor([ids]))[0], _llama_logits(f32, ids)
        assert (ours - theirs).abs().max().item() < 1e-5
        assert (ours - _llama_logits(f16, ids)).abs().max().item() < 1e-3
        flips = ours.argmax(-1) != theirs.argmax(-1)
        assert (tie_gap(ours, theirs.argmax(-1))[flips] < TIE).all()
        greedy = list(generate(model, ids, max_new_tokens=24))
        f32.reset()
        f32.eval(ids)
        theirs_greedy = []
        for _ in greedy:
            theirs_greedy.append(int(np.argmax(f32.scores[f32.n_tokens - 1])))
            f32.eval(theirs_greedy[-1:])
        assert_greedy_agrees(model, ids, greedy, theirs_greedy)


def test_llama_cpp_q8_0_picks_our_next_token_almost_everywhere(
    llama_cpp, out, gguf_files, one_thread
):
    """Q8_0 rounds every weight (and llama.cpp its activations) by up to 1/254 of its block's
    largest: the argmax may flip where our two best logits nearly tie, on at most 5% of the
    positions (measured: 6 of 306, with llama.cpp's default f16 key/value cache)."""
    model, llm = load_model(out), _llama(llama_cpp, gguf_files["q8_0"], logits_all=True)
    same = total = 0
    for ids in _prompts(out):
        ours, theirs = logits(model, torch.tensor([ids]))[0], _llama_logits(llm, ids)
        same += (ours.argmax(-1) == theirs.argmax(-1)).sum().item()
        total += len(ids)
    assert same / total >= 0.95


def test_the_train_flag_takes_a_type_or_none_and_needs_the_package(tmp_path, monkeypatch):
    from llama_ddp.settings import literal_choices
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.config import FLAGS

    assert literal_choices(FLAGS["export_gguf"].hint) == tuple(GGUF_TYPES)
    assert parse_train_args([]).output.export_gguf is None
    assert parse_train_args(["--export-gguf", "--preset", "tiny"]).output.export_gguf == "f32"
    assert parse_train_args(["--export-gguf", "q8_0"]).output.export_gguf == "q8_0"
    (tmp_path / "run.toml").write_text('export-gguf = "q4_0"\n')
    with pytest.raises(UserError, match="--export-gguf 'q4_0' is not one of: f32, f16, bf16"):
        parse_train_args(["--config", str(tmp_path / "run.toml")])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else find_spec(n, *a)
    )
    with pytest.raises(UserError, match=r"needs the gguf package \(pip install 'llama_ddp\[gguf"):
        parse_train_args(["--export-gguf", "f16"])
    assert parse_train_args([]).output.export_gguf is None  # no export, no package needed


def test_generate_runs_an_exported_file_with_its_own_tokenizer(out, tmp_path, capsys):
    """The round trip a user makes: export, then generate from the .gguf alone (its tokenizer
    read from the file) gives the text the run folder gives."""
    from llama_ddp.generate import main as generate_main

    path = tmp_path / "m.gguf"
    assert export_main([str(out), "--gguf", str(path)]) == 0
    capsys.readouterr()
    args = ["--prompt", "def f(x):", "--max-new-tokens", "6", "--temperature", "0"]
    assert generate_main(["--model", str(out), *args]) == 0
    expected = capsys.readouterr().out
    assert generate_main(["--model", str(path), *args]) == 0
    assert capsys.readouterr().out == expected


def test_export_onto_a_disk_that_refuses_the_write_is_one_line_and_keeps_the_old_file(
    out, tmp_path
):
    """A file size limit (a full disk as the writer sees it) cuts the f32 GGUF short: one line,
    exit 2, the old file as it was and no temporary left (a process limit: a subprocess)."""
    import resource
    import signal
    import subprocess
    import sys

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write (EFBIG), don't kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    old = tmp_path / "m.gguf"
    old.write_bytes(b"the old export")
    cmd = [sys.executable, "-m", "llama_ddp.export", str(out), "--gguf", str(old), "--force"]
    done = subprocess.run(
        [*cmd, "--type", "f32"], capture_output=True, text=True, timeout=120, preexec_fn=limit
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write GGUF file {old}: "), lines
    assert "the write stopped short" in lines[0] or "too large" in lines[0]
    assert old.read_bytes() == b"the old export"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
