"""hf.py: our Llama as transformers reads it and back; a hub Llama as --init-from."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llama_ddp.checkpoint.manager import list_checkpoints
from llama_ddp.data.tokenizer_files import read_tokenizer
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.eval.windows import windows
from llama_ddp.generation.generate import generate_text
from llama_ddp.interop.hf import export_hf, read_hf
from llama_ddp.interop.load import load_model, read_source
from llama_ddp.interop.native import save_model
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.weights import load_weights
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.run import build_trainer, resume
from llama_ddp.train.validation import held_out
from tests.helpers.runs import train_here

transformers = pytest.importorskip("transformers")


@pytest.fixture()
def model():
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=211)  # GQA: 4 heads, 2 KV heads
    m = LlamaForPretraining(config).eval()
    with torch.no_grad():  # random norms too, so parity covers their weights
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return m


def test_transformers_gives_the_same_logits(model, tmp_path):
    export_hf(model, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 211, (2, 64))
    with torch.no_grad():
        ours = model(ids)
        ref = theirs(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5


def test_auto_model_loads_the_export(model, tmp_path):
    export_hf(model, tmp_path / "hf")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(auto).__name__ == "LlamaForCausalLM"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False


def test_round_trip_gives_identical_weights(model, tmp_path):
    back = load_model(export_hf(model, tmp_path / "hf"))
    assert back.config == model.config
    ours, theirs = model.state_dict(), back.state_dict()
    assert list(ours) == list(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_export_replaces_a_previous_export(model, tmp_path):
    export_hf(model, tmp_path / "hf")
    (tmp_path / "hf" / "stale.txt").write_text("x")
    export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf" / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_import_of_a_missing_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="config.json not found"):
        read_hf(tmp_path / "nothing")


# --- --init-from: a Hugging Face Llama (or our llama_model.pth) as the start of a new run -------


def hub_tokenizer(texts: list[str], folder: Path) -> None:
    """A byte-level BPE with <s> and </s> and no pad token, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def hub_model(folder: Path, *, tied: bool = True, shard: str | None = None, **config):
    """A randomly initialized transformers Llama (GQA, a vocabulary larger than the tokenizer's,
    non-default rope_theta and rms_norm_eps) saved in ``folder``."""
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=384, rope_theta=5e5, rms_norm_eps=1e-6, tie_word_embeddings=tied, **shape
    )
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norms, so that their weights are checked too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.config.update(config)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.mark.parametrize(
    "tied, shard", [(True, "60KB"), (False, None)], ids=["tied-sharded", "untied"]
)
def test_a_hub_llama_loads_with_its_logits(tmp_path, tied, shard):
    theirs = hub_model(tmp_path, tied=tied, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    config, state = read_source(tmp_path)
    assert (config.rope_theta, config.rms_norm_eps, config.num_key_value_heads) == (5e5, 1e-6, 2)
    model = LlamaForPretraining(config).eval()
    load_weights(model, state, "source")
    ids = torch.randint(0, 384, (2, 40))
    with torch.no_grad():
        assert (model(ids) - theirs(ids).logits).abs().max().item() < 1e-5
    head, embed = model.lm_head.weight, model.base_model.embed_tokens.weight
    assert (head is embed) == tied == model.config.tie_word_embeddings  # one matrix when tied
    assert model.num_parameters() == theirs.num_parameters()
    weights = "model.safetensors.index.json" if shard else "model.safetensors"
    for file in ("config.json", weights):  # a file of the folder names the folder
        again = read_source(tmp_path / file)
        assert again[0] == config and all(torch.equal(again[1][k], v) for k, v in state.items())


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/x.safetensors", "sub/x", ".."])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, shard):
    hub_model(tmp_path / "model", tied=True, shard="60KB")
    index = tmp_path / "model" / "model.safetensors.index.json"
    listing = json.loads(index.read_text())
    listing["weight_map"]["lm_head.weight"] = shard
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")  # what ../ would reach
    index.write_text(json.dumps(listing))
    with pytest.raises(UserError, match="names the shard .*, not a file of its folder"):
        read_source(tmp_path / "model")


def test_our_llama_model_pth_is_a_source_too(model, tmp_path):
    save_model(model, model.config, tmp_path)
    for path in ("llama_model.pth", "llama_model.json", ""):
        config, state = read_source(tmp_path / path)
        assert config == model.config
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' (only 'llama') is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "RoPE scaling 'llama3' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
        ({"attention_bias": True}, "attention_bias true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"head_dim": 32}, "head_dim 32 (not hidden_size / num_attention_heads)"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused(tmp_path, change, message):
    hub_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=re.escape(message)):
        read_source(tmp_path)


def test_shape_flags_must_agree_with_the_source():
    source = preset("tiny", vocab_size=400)
    cfg = TrainConfig.from_flags(
        init_from="SRC", tokenizer="SRC", hidden_size=64, num_hidden_layers=3
    )
    with pytest.raises(UserError) as err:
        cfg.check_source(source)
    assert str(err.value) == (
        "--init-from SRC: --num-hidden-layers 3 contradicts its num_hidden_layers 2 (drop the "
        "shape flags: the shape comes from the source)"
    )
    cfg = TrainConfig.from_flags(init_from="SRC", tokenizer="SRC", hidden_size=64, seq_length=64)
    assert cfg.model_config(400, source) == source  # --preset small does not apply
    with pytest.raises(UserError, match="the tokenizer has 401 tokens, more than the 400"):
        cfg.model_config(401, source)
    with pytest.raises(UserError, match="--init-from needs the tokenizer its model was trained"):
        TrainConfig.from_flags(init_from="SRC").validate()


@pytest.mark.e2e
def test_init_from_a_hub_folder_starts_from_its_logits(hub_run, train_env, tmp_path):
    source, out, args, first, _ = hub_run
    theirs = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    assert f"initial weights from {source}\n" in first.stdout
    assert f"parameters: {theirs.num_parameters():,}, as the source\n" in first.stdout
    tok = transformers.AutoTokenizer.from_pretrained(source)
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    roles = f"BOT <- <|endoftext|> ({end}), EOT <- <|endoftext|> ({end}), PAD <- <|endoftext|>"
    assert f"special tokens: {roles} ({end})" in first.stdout
    cache = str(train_env["root"] / "cache")
    cfg = parse_train_args([*args, "--out-dir", str(tmp_path), "--cache-dir", cache])
    rt = D.setup("single", "cpu")
    trainer = build_trainer(cfg, rt)  # as the run built its model, before any step
    assert trainer.model.lm_head.weight is trainer.model.base_model.embed_tokens.weight
    batch = next(trainer.data.batches(0))[0]
    assert (batch.x == end).any() and not (batch.x == tok.bos_token_id).any()  # its roles
    with torch.no_grad():
        assert (trainer.model(batch.x) - theirs(batch.x).logits).abs().max().item() < 1e-5
    # The run's step-0 evaluation is the source's loss on every validation token, each document
    # alone with its earlier context up to --seq-length (`windows`), as transformers scores it.
    split = held_out(trainer.data).tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(split.offsets[:-1].tolist(), split.offsets[1:].tolist()):
            doc = torch.as_tensor(split[a:b].astype("int64"))
            for start, stop, first_scored in windows(b - a, 48):
                logits = theirs(doc[None, start:stop]).logits[0, first_scored - start :]
                targets = doc[first_scored + 1 : stop + 1]
                total += F.cross_entropy(logits, targets, reduction="sum").item()
                count += len(targets)
    assert count == split.num_tokens - split.num_docs  # every held-out target, once
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in records if "val_loss" in r)  # after the run's dtype line
    assert step0["step"] == 0 and step0["val_loss"] == pytest.approx(total / count, rel=1e-5)
    # The roles are part of what a resume must agree on.
    other = parse_train_args([*args[:-2], "--eot-token", "<|im_end|>", "--out-dir", str(out)])
    with pytest.raises(UserError, match="different special tokens .*eot <\\|endoftext"):
        resume(build_trainer(other, rt), other, list_checkpoints(out)[-1])


@pytest.mark.e2e
def test_a_resumed_init_from_run_needs_no_source_weights(hub_run, train_env, tmp_path):
    """Resuming takes the checkpoint's shape and weights: the source's weights (a 1B model's
    gigabytes) are not read, and may be gone; extending the run works without them."""
    source, out, args, _, _ = hub_run
    shutil.copytree(out, tmp_path / "out")
    shutil.copytree(source, tmp_path / "source", ignore=shutil.ignore_patterns("*.safetensors"))
    moved = {str(source): str(tmp_path / "source")}
    assert args[-2] == "--out-dir"
    base = [moved.get(a, a) for a in args[:-2]]
    extended = train_here(
        train_env, [*base, "--max-steps", "12", "--out-dir", str(tmp_path / "out")]
    )
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "resuming from" in extended.stdout and "step-00000010" in extended.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "out/metrics.jsonl").open()]
    assert steps[-1] == 12
    with pytest.raises(UserError, match="has neither model.safetensors"):
        read_source(tmp_path / "source")  # what a new run from it reads


@pytest.mark.e2e
def test_the_export_keeps_what_the_source_is(hub_run):
    """Tied as the source (one matrix, its parameter count), its tokenizer config (chat template,
    unk and other special tokens) and generation config as they were; our roles recorded beside
    them; and transformers generates with it what we generate."""
    source, out, _, _, again = hub_run
    assert "note: --init-from" in again.stdout and "unused: the checkpoint is newer" in again.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.3
    state = torch.load(out / "llama_model.pth", weights_only=True)
    assert torch.equal(state["lm_head.weight"], state["base_model.embed_tokens.weight"])
    stored = load_file(out / "hf" / "model.safetensors")
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    theirs = transformers.AutoModelForCausalLM.from_pretrained(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert model.config.tie_word_embeddings and model.num_parameters() == theirs.num_parameters()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config = json.loads((out / "hf" / "config.json").read_text())
    assert (config["rope_theta"], config["rms_norm_eps"]) == (5e5, 1e-6)
    # The tokenizer is the source's, with our roles recorded for llama_ddp.
    tok, src = (transformers.AutoTokenizer.from_pretrained(p) for p in (out / "hf", source))
    for t in (tok, src):
        names = (t.bos_token, t.eos_token, t.pad_token, t.unk_token)
        assert names == ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>")
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "runs"}]
    for prompt in (True, False):
        theirs_text = src.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )
        assert (
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            == theirs_text
        )
    for folder in (out, out / "hf"):
        assert (folder / "generation_config.json").read_text() == (
            source / "generation_config.json"
        ).read_text()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        roles = config.pop("llama_ddp_roles")
        assert roles == {"bot": "<|endoftext|>", "eot": "<|endoftext|>", "pad": "<|endoftext|>"}
        # every other entry as the source's (unk, add_bos_token, the chat template, ...)
        assert config == json.loads((source / "tokenizer_config.json").read_text())
    # Our generation frames the prompt and stops with the run's roles; so does transformers' here.
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    prompt = torch.tensor([[end, *tok.encode("the cat", add_special_tokens=False)]])
    with torch.no_grad():
        new = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=end)
    new = new[0, prompt.shape[1] :]
    ours, (our_tok, special) = load_model(out), read_tokenizer(out)
    text = generate_text(ours, our_tok, "the cat", max_new_tokens=8, special=special.ids)
    assert text == "the cat" + tok.decode(new, skip_special_tokens=True)
