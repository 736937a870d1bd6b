import json

import pytest
import torch

from llama_ddp.config import preset
from llama_ddp.errors import UserError
from llama_ddp.hf import export_hf, import_hf
from llama_ddp.model import LlamaForPretraining

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
    back = import_hf(export_hf(model, tmp_path / "hf"))
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
        import_hf(tmp_path / "nothing")
