"""export.py: llama_model.pth/.json and the tokenizer's files round trip; a run's last words."""

from pathlib import Path

import torch

from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import read_tokenizer, save_tokenizer
from llama_ddp.interop.load import load_model
from llama_ddp.interop.native import run_summary, save_model
from llama_ddp.model.config import LlamaConfig
from tests.helpers.runs import tiny


def test_the_model_and_its_tokenizer_round_trip_and_replace_an_older_export(tok, tmp_path):
    tok_path = tmp_path / "tokenizer" / "tokenizer.json"
    tok_path.parent.mkdir()
    save_tokenizer(tok, tok_path)
    out = tmp_path / "out"
    for seed in (1, 2):  # the second export replaces the first
        model = tiny(tok.get_vocab_size(), seed=seed)
        assert save_model(model, model.config, out, tok_path) == out / "llama_model.pth"
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "llama_model.json",
        "llama_model.pth",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    state, saved = model.state_dict(), torch.load(out / "llama_model.pth", weights_only=True)
    assert list(saved) == list(state) and all(torch.equal(saved[k], v) for k, v in state.items())
    assert LlamaConfig.load(out / "llama_model.json") == model.config
    back = load_model(out)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    tokenizer, roles = read_tokenizer(out)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(tok)
    assert roles == read_tokenizer(tok_path)[1]


def test_a_wrapped_tied_state_is_saved_under_the_plain_names_as_one_matrix(tmp_path):
    model = tiny(64, tie_word_embeddings=True)
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}  # DDP, compile
    save_model(wrapped, model.config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama_model.json", "llama_model.pth"]
    saved = torch.load(tmp_path / "llama_model.pth", weights_only=True)
    assert list(saved) == list(model.state_dict())
    embedding, head = saved["base_model.embed_tokens.weight"], saved["lm_head.weight"]
    assert torch.equal(embedding, model.lm_head.weight)
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()


def test_the_end_of_a_run_names_its_files_and_the_next_commands():
    out, checkpoint = Path("a"), Path("a/checkpoints/step-00000012")
    assert run_summary(out, checkpoint, hf=True).splitlines() == [
        "saved a/llama_model.pth (with llama_model.json and tokenizer.json: the model)",
        "      a/metrics.jsonl (the curves)",
        "      a/hf/ (for transformers)",
        "      a/checkpoints/step-00000012/ (to resume, or to extend with a larger --max-steps)",
        "next:",
        '  python -m llama_ddp.generate --model a/llama_model.pth --prompt "..."',
        "  python -m llama_ddp.plot a/metrics.jsonl",
        '  transformers.AutoModelForCausalLM.from_pretrained("a/hf")',
    ]
    budgeted = run_summary(out, checkpoint, hf=False, budgeted=True).splitlines()
    assert budgeted[2] == (  # a larger --time-budget does not extend a finished budget run
        "      a/checkpoints/step-00000012/ (to resume, or to start another with --init-from)"
    )
    assert run_summary(out, None, hf=False).splitlines() == [
        "saved a/llama_model.pth (with llama_model.json and tokenizer.json: the model)",
        "      a/metrics.jsonl (the curves)",
        "next:",
        '  python -m llama_ddp.generate --model a/llama_model.pth --prompt "..."',
        "  python -m llama_ddp.plot a/metrics.jsonl",
    ]
