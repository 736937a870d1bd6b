"""Reading any source into our model: tied embeddings, GGUF files, the parameter count."""

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.model.config import LlamaConfig, preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.weights import load_weights, parameter_count
from llama_ddp.train import run
from llama_ddp.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")


def test_a_tied_model_has_one_matrix_under_two_names():
    config = preset("tiny", vocab_size=300, tie_word_embeddings=True)
    model = LlamaForPretraining(config)
    assert model.lm_head.weight is model.base_model.embed_tokens.weight
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["base_model.embed_tokens.weight"].data_ptr()
    untied = LlamaForPretraining(preset("tiny", vocab_size=300))
    assert untied.num_parameters() - model.num_parameters() == 300 * 64
    assert parameter_count(config) == model.num_parameters()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(params) == len(set(params)) == len(list(model.parameters()))  # no duplicate
    # llama_model.json: absent is untied, so an untied model's file is what older versions wrote
    assert config.to_dict()["tie_word_embeddings"] is True
    assert "tie_word_embeddings" not in untied.config.to_dict()
    assert LlamaConfig.from_dict(untied.config.to_dict()) == untied.config


def test_an_untied_state_does_not_load_as_tied():
    untied = LlamaForPretraining(preset("tiny", vocab_size=300)).state_dict()
    tied = LlamaForPretraining(preset("tiny", vocab_size=300, tie_word_embeddings=True))
    with pytest.raises(UserError, match="has an lm_head other than its embedding, but its config"):
        load_weights(tied, untied, "model x")
    untied.pop("lm_head.weight")  # a tied state may name the embedding only
    load_weights(tied, untied, "model x")
    assert torch.equal(tied.lm_head.weight, untied["base_model.embed_tokens.weight"])


def test_the_run_says_when_its_parameters_are_not_the_sources():
    tied = preset("tiny", vocab_size=300, tie_word_embeddings=True)
    same = LlamaForPretraining(tied)
    assert (
        run.source_parameters(same, tied) == f"parameters: {same.num_parameters():,}, as the source"
    )
    untied = LlamaForPretraining(preset("tiny", vocab_size=300))
    assert run.source_parameters(untied, tied) == (
        f"parameters: {untied.num_parameters():,}; the source has {same.num_parameters():,} "
        "(its tied embeddings are untied)"
    )


def test_a_run_starts_from_a_gguf_file(chat_model, train_env, tmp_path):
    """train.py --init-from model.gguf --tokenizer model.gguf: the run's model, dequantized to
    fp32, tied, gives transformers' logits for that file on the run's own batches."""
    from llama_ddp.distributed import runtime as D
    from llama_ddp.train.cli import parse_train_args

    path = chat_model["gguf"]
    args = ["--init-from", str(path), "--tokenizer", str(path), "--dataset",
            str(train_env["corpus"]), "--seq-length", "48", "--batch-size", "8",
            "--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    trainer = run.build_trainer(parse_train_args(args), D.setup("single", "cpu"))
    model = trainer.model
    assert model.lm_head.weight is model.base_model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert model.num_parameters() == theirs.num_parameters()
    x = next(trainer.data.batches(0))[0].x
    with torch.no_grad():
        assert (model(x) - theirs(x).logits).abs().max().item() < 1e-5
