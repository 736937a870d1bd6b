"""checkpoint.py: every part saved is read back, in any layout; what is not state stays the run's."""

import json

import pytest
import torch

from llama_ddp import checkpoint as ckpt
from llama_ddp.errors import Interrupted, UserError
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import preset
from llama_ddp.optim import build_optimizer


def trained_model(foreach: bool) -> tuple[LlamaForPretraining, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    optimizer.param_groups[0]["foreach"] = foreach
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def parts(model, optimizer, scaler) -> dict[str, ckpt.Stateful]:
    return {
        "settings": ckpt.Settings({"model_shape": model.config.to_dict()}),
        "model": ckpt.ModelState(model),
        "optimizer": ckpt.OptimizerState(model, optimizer),
        "scaler": scaler,
        "rng": ckpt.RNGState(),
    }


def test_parts_round_trip_exactly_and_the_scaler_with_them(tmp_path):
    model, optimizer = trained_model(foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 37.0, "_growth_tracker": 5})
    path = ckpt.save_checkpoint(tmp_path, 3, parts(model, optimizer, scaler), keep_last=2)
    assert ckpt.verify_checkpoint(path) is None
    assert json.loads((path / "state.json").read_text())["parts"]["scaler"]["scale"] == 37.0
    assert ckpt.saved_setting(path, "model_shape") == model.config.to_dict()  # before any model
    with pytest.raises(UserError, match="does not record its document mask"):
        ckpt.saved_setting(path, "document_mask")
    expected_rng = torch.get_rng_state()
    torch.rand(5)  # move the generator on: loading must bring it back

    fresh = LlamaForPretraining(preset("tiny", vocab_size=64))
    fresh_opt = build_optimizer(fresh, lr=5e-4, weight_decay=0.1)
    fresh_opt.param_groups[0]["foreach"] = False  # this run's own implementation choice
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert ckpt.load_checkpoint(path, parts(fresh, fresh_opt, fresh_scaler)) == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_opt.state[q][key])
    assert fresh_opt.param_groups[0]["lr"] == 1e-3  # saved state: the checkpoint's
    assert fresh_opt.param_groups[0]["foreach"] is False  # implementation: this run's
    assert fresh_scaler.get_scale() == 37.0 and fresh_scaler._get_growth_tracker() == 5
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_settings_that_differ_are_named_before_any_tensor_is_read(tmp_path):
    model, _ = trained_model(foreach=True)
    settings = {"model_shape": model.config.to_dict(), "seq_length": 64, "tokenizer": "abc"}
    path = ckpt.save_checkpoint(
        tmp_path, 1, {"settings": ckpt.Settings(settings), "model": ckpt.ModelState(model)},
        keep_last=1,
    )  # fmt: skip
    other = LlamaForPretraining(preset("tiny", vocab_size=64, hidden_size=128))
    changed = {"model_shape": other.config.to_dict(), "seq_length": 32, "tokenizer": "xyz"}
    parts = {"settings": ckpt.Settings(changed), "model": ckpt.ModelState(other)}
    with pytest.raises(UserError) as err:
        ckpt.load_checkpoint(path, parts)
    message = str(err.value)
    assert "a different model shape (hidden_size 64 vs 128)" in message
    assert "a different seq length (64 vs 32 now)" in message
    assert "a different tokenizer" in message
    assert "another --out-dir, or delete OUT/checkpoints" in message
    (path / "state.json").write_text('{"step": ')  # damaged: one line, not a traceback
    with pytest.raises(UserError, match="checkpoint state .*state.json is not readable JSON"):
        ckpt.load_checkpoint(path, parts)


def test_a_save_cut_short_leaves_no_temporary_and_the_last_checkpoint_intact(tmp_path, monkeypatch):
    model, optimizer = trained_model(foreach=True)
    parts = {"model": ckpt.ModelState(model), "optimizer": ckpt.OptimizerState(model, optimizer)}
    first = ckpt.save_checkpoint(tmp_path, 1, parts, keep_last=2)

    def interrupted(path):  # a second Ctrl-C while the files of step 2 are being checksummed
        raise Interrupted(2, "again")

    monkeypatch.setattr(ckpt, "_sha256", interrupted)
    with pytest.raises(Interrupted):
        ckpt.save_checkpoint(tmp_path, 2, parts, keep_last=2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    monkeypatch.undo()
    assert ckpt.verify_checkpoint(first) is None


def test_a_tied_model_resumes_with_one_matrix(tmp_path):
    """The embedding and lm_head are one Parameter: DCP saves it under both names, loads it back
    into the one matrix of a fresh tied model, and AdamW's state of it once."""
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64, tie_word_embeddings=True))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path = ckpt.save_checkpoint(tmp_path, 1, parts(model, optimizer, scaler), keep_last=2)
    fresh = LlamaForPretraining(preset("tiny", vocab_size=64, tie_word_embeddings=True))
    fresh_opt = build_optimizer(fresh, lr=1e-3, weight_decay=0.1)
    ckpt.load_checkpoint(path, parts(fresh, fresh_opt, scaler))
    assert fresh.lm_head.weight is fresh.base_model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, model.base_model.embed_tokens.weight)
    assert len(fresh_opt.state) == len(list(fresh.parameters()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    untied = LlamaForPretraining(preset("tiny", vocab_size=64))  # another shape: refused
    untied_opt = build_optimizer(untied, lr=1e-3, weight_decay=0.1)
    with pytest.raises(UserError, match="tie_word_embeddings True vs None"):
        ckpt.load_checkpoint(path, parts(untied, untied_opt, scaler))
