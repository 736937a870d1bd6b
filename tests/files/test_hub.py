"""hub.py: hub repository ids told from local paths, and found in the hub cache offline."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from llama_ddp.errors import UserError
from llama_ddp.files.hub import MODEL_FILES, TOKENIZER_FILES, is_repo_id, local_path
from llama_ddp.generate import main as generate_main
from llama_ddp.interop.load import read_source
from tests.helpers.runs import fake_hub_cache, run_train


@pytest.mark.parametrize(
    "name, repo",
    [
        ("HuggingFaceTB/SmolLM2-135M", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("someone/model.gguf", False),  # a file name: a path, reported as missing
        ("someone/tokenizer.json", False),
        ("someone/llama_model.pth", False),
        ("a/b/c", False),
        ("a", False),
        ("/a/b", False),
        ("./a/b", False),
    ],
)
def test_an_owner_slash_name_that_names_no_file_is_a_repository_id(name, repo):
    assert is_repo_id(name) is repo


def test_local_paths_are_returned_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "out").mkdir()
    for name in ("out/llama_model.pth", "out/smal", "someone/model.gguf", "/a/b", "x"):
        assert local_path(name, MODEL_FILES, "--model") == Path(name)
    assert local_path("~/run", MODEL_FILES, "--model") == tmp_path / "home" / "run"


def test_a_cached_repository_is_its_snapshot_folder_offline(tmp_path, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    (files / "tokenizer.json").write_text("{}")
    cache = fake_hub_cache(tmp_path / "hub", "someone/tok", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    found = local_path("someone/tok", TOKENIZER_FILES, "--tokenizer")
    assert found == next((cache / "models--someone--tok" / "snapshots").iterdir())
    assert (found / "tokenizer.json").read_text() == "{}"


def test_an_unknown_repository_offline_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError) as error:
        local_path("someone/missing", TOKENIZER_FILES, "--tokenizer")
    message = str(error.value)
    assert message.startswith("--tokenizer someone/missing is neither a local path nor a hub")
    assert "(LocalEntryNotFoundError: " in message and "\n" not in message


@pytest.mark.e2e
def test_hub_names_resolve_through_the_hub_cache(hub_run, train_env, tmp_path, monkeypatch, capsys):
    source, out, args, _, _ = hub_run
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-llama", source)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert is_repo_id("someone/tiny-llama") and is_repo_id("Qwen/Qwen2.5-0.5B")
    assert not any(map(is_repo_id, ["out/llama_model.pth", "./a/b", "/a/b", "a", str(source)]))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not is_repo_id("runs/smal")  # a typo under an existing folder: a missing path
    config, state = read_source("someone/tiny-llama")
    theirs = read_source(source)
    assert config == theirs[0] and all(torch.equal(state[k], v) for k, v in theirs[1].items())
    with pytest.raises(UserError, match="someone/missing is neither a local path nor a hub"):
        read_source("someone/missing")
    # From the command line: train.py starts from it (the same step-0 loss as from the folder),
    # generate reads it, and an unknown name is one line.
    env = {**train_env, "env": {**train_env["env"], "HF_HUB_CACHE": str(cache)}}
    named = {str(source): "someone/tiny-llama"}
    base = [named.get(a, a) for a in args[:-2]]
    run = run_train(env, [*base, "--max-steps", "1", "--out-dir", str(tmp_path / "out")])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "initial weights from someone/tiny-llama\n" in run.stdout

    def step0_val_loss(folder: Path) -> float:
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in records if "val_loss" in r)  # after the run's dtype line
        assert first["step"] == 0
        return first["val_loss"]

    assert step0_val_loss(tmp_path / "out") == step0_val_loss(out)
    texts = []
    for model in ("someone/tiny-llama", str(source)):
        assert generate_main(["--model", model, "--prompt", "the cat", "--temperature", "0",
                              "--max-new-tokens", "4"]) == 0  # fmt: skip
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("the cat")
    assert generate_main(["--model", "someone/missing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model someone/missing is neither a local path" in err
