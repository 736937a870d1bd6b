"""interop/load.py: one loader: every kind of saved model (with its tokenizer, for evaluation)."""

import json
import shutil

import pytest
import torch
from huggingface_hub import constants

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import step_dir
from llama_ddp.data.tokenizer import tokenizer_fingerprint
from llama_ddp.data.tokenizer_files import save_tokenizer, special_ids
from llama_ddp.errors import UserError
from llama_ddp.evaluate import main
from llama_ddp.interop.load import load_for_evaluation, load_model, read_source
from tests.helpers.runs import fake_hub_cache

CPU = torch.device("cpu")


@pytest.mark.parametrize("form", ["", "llama_model.pth", "llama_model.json", "hf"])
def test_a_run_folder_its_files_and_its_hf_folder_give_the_same_model(out, tok, form):
    model, tokenizer, ids = load_for_evaluation(str(out / form), None, CPU)
    saved = torch.load(out / "llama_model.pth", weights_only=True)
    state = model.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert not model.training
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(tok)
    assert ids == special_ids(tok)


def test_a_model_without_its_tokenizer_needs_one_it_fits(out, tiny_tokenizer, tmp_path):
    for name in ("llama_model.pth", "llama_model.json"):
        shutil.copy(out / name, tmp_path / name)
    with pytest.raises(UserError, match=f"no tokenizer.json beside the model in {tmp_path}"):
        load_for_evaluation(str(tmp_path), None, CPU)
    model, _, _ = load_for_evaluation(str(tmp_path), str(out / "tokenizer.json"), CPU)
    assert torch.equal(
        model.lm_head.weight,
        torch.load(out / "llama_model.pth", weights_only=True)["lm_head.weight"],
    )
    larger = tmp_path / "larger.json"
    save_tokenizer(tiny_tokenizer, larger)
    size = tiny_tokenizer.get_vocab_size()
    vocab = model.config.vocab_size
    with pytest.raises(UserError, match=f"the tokenizer has {size} tokens, the model only {vocab}"):
        load_for_evaluation(str(tmp_path), str(larger), CPU)


def test_a_run_without_its_model_file_is_read_from_its_newest_checkpoint(
    out, tok, tiny_tokenizer, tmp_path, capsys
):
    """A stopped run: its checkpoint's weights, in a model of the shape it records, with the
    tokenizer it was trained with (the run folder's, or one passed that has its fingerprint)."""
    saved = load_model(out)
    settings = {"model_shape": saved.config.to_dict(), "tokenizer": tokenizer_fingerprint(tok)}
    parts = {"settings": ckpt.Settings(settings), "model": ckpt.ModelState(saved)}
    for step in (2, 3):
        ckpt.save_checkpoint(step_dir(tmp_path, step), step, parts)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    model, tokenizer, _ = load_for_evaluation(str(tmp_path), None, CPU)
    assert "has no llama_model.pth yet: reading its checkpoint step-00000003" in (
        capsys.readouterr().err
    )
    assert not model.training and model.config == saved.config
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(tok)
    (tmp_path / "tokenizer.json").unlink()
    checkpoint = step_dir(tmp_path, 2)
    assert load_for_evaluation(str(checkpoint), str(out), CPU)[0].config == saved.config
    save_tokenizer(tiny_tokenizer, tmp_path / "other.json")
    with pytest.raises(UserError, match=f"checkpoint {checkpoint} was trained with another"):
        load_for_evaluation(str(checkpoint), str(tmp_path / "other.json"), CPU)


def test_a_folder_without_a_model_is_one_line(tmp_path):
    with pytest.raises(UserError, match="holds no model: no llama_model.pth, config.json or"):
        load_for_evaluation(str(tmp_path), None, CPU)


@pytest.mark.e2e
def test_a_saved_model_scores_what_the_loop_logged(task_run, tmp_path, capsys, monkeypatch):
    """Every form of the same weights gives the scores the loop logged at that step."""
    out, task = task_run
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-run", out / "hf")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    logged = {
        r["step"]: r["tasks"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "tasks" in r
    }
    forms = {
        "run folder": (out, 10),
        "llama_model.pth": (out / "llama_model.pth", 10),
        "hf/": (out / "hf", 10),
        "hub id": ("someone/tiny-run", 10),
        "checkpoint": (out / "checkpoints" / "step-00000004", 4),
    }
    for name, (model, step) in forms.items():
        result = tmp_path / name.replace("/", "") / "scores.json"  # its folder is made
        args = ["--model", str(model), "--tasks", str(task), "--limit", "10"]
        assert main([*args, "--output", str(result)]) == 0, name
        scores = json.loads(result.read_text())
        assert scores.keys() == {"words"}
        for key in ("acc", "acc_norm", "n"):
            assert scores["words"][key] == pytest.approx(logged[step]["words"][key]), name
        table = capsys.readouterr().out
        assert "words" in table and f"{scores['words']['acc']:.4f}" in table


@pytest.mark.e2e
def test_a_stopped_run_folder_is_scored_from_its_newest_checkpoint(task_run, tmp_path, capsys):
    out, task = task_run
    stopped = tmp_path / "stopped"
    shutil.copytree(out / "checkpoints", stopped / "checkpoints")
    shutil.rmtree(stopped / "checkpoints" / "step-00000010")
    assert main(["--model", str(stopped), "--tasks", str(task)]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    assert main(["--model", str(stopped), "--tasks", str(task), "--tokenizer", str(out)]) == 0
    assert "reading its checkpoint step-00000008" in capsys.readouterr().err


def test_one_loader_reads_a_checkpoint_folder_for_every_command(out, tok, tmp_path, capsys):
    """generate, --init-from and export read models through read_source/load_model: a
    checkpoint folder and a run folder that has only checkpoints give the checkpoint's weights,
    as evaluation's loader does."""
    saved = load_model(out)
    settings = {"model_shape": saved.config.to_dict(), "tokenizer": tokenizer_fingerprint(tok)}
    parts = {"settings": ckpt.Settings(settings), "model": ckpt.ModelState(saved)}
    ckpt.save_checkpoint(step_dir(tmp_path, 5), 5, parts)
    for where in (step_dir(tmp_path, 5), tmp_path):
        config, state = read_source(where)
        assert config == saved.config
        assert all(torch.equal(state[k], v) for k, v in saved.state_dict().items())
        model = load_model(where)
        assert not model.training
        assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    assert "has no llama_model.pth yet: reading its checkpoint step-00000005" in (
        capsys.readouterr().err
    )
    with pytest.raises(UserError, match="holds no model"):
        read_source(tmp_path / "checkpoints")


def _poisoned(out, tmp_path, value: float):
    """Copies of the saved model ``out`` whose one weight holds ``value``: its llama_model.pth
    folder, its hf/ folder and a checkpoint of it."""
    from safetensors.torch import load_file, save_file

    from llama_ddp.interop.native import save_model

    model = load_model(out)
    with torch.no_grad():
        model.base_model.layers[1].mlp.up_proj.weight[3, 5] = value
    native = tmp_path / "native"
    save_model(model, model.config, native, out / "tokenizer.json")
    hf = tmp_path / "hf"
    shutil.copytree(out / "hf", hf)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, hf / "model.safetensors")
    parts = {"settings": ckpt.Settings({"model_shape": model.config.to_dict()}),
             "model": ckpt.ModelState(model)}  # fmt: skip
    checkpoint = ckpt.save_checkpoint(step_dir(tmp_path / "run", 5), 5, parts)
    return [native, native / "llama_model.pth", hf, checkpoint]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_weights_that_are_not_finite_are_refused_by_the_one_loader(out, tmp_path, value):
    """generate, evaluate, export and --init-from all read through read_source: a NaN or an
    infinity in any weight of any form is one line that says so, naming the weight, and never
    blames the learning rate."""
    for source in _poisoned(out, tmp_path, value):
        with pytest.raises(UserError) as err:
            read_source(source)
        message = str(err.value)
        assert "its weights are not finite" in message, message
        assert "layers.1.mlp.up_proj.weight holds 1 NaN or infinite values of" in message
        assert "learning rate" not in message and "--lr" not in message


def test_every_command_refuses_a_model_whose_weights_are_not_finite(out, tmp_path, capsys):
    from llama_ddp.export import main as export
    from llama_ddp.generate import main as generate

    native = _poisoned(out, tmp_path, float("nan"))[0]
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n')
    commands = [
        lambda: generate(["--model", str(native), "--prompt", "def"]),
        lambda: main(["--model", str(native), "--tasks", str(task)]),
        lambda: export([str(native), "--gguf", str(tmp_path / "m.gguf"), "--type", "f32"]),
    ]
    for command in commands:
        assert command() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "its weights are not finite" in err, err
    assert not (tmp_path / "m.gguf").exists()


def test_no_command_reports_a_number_for_a_model_whose_outputs_are_not_finite(
    out, tmp_path, capsys
):
    """Finite weights whose logits overflow fp32 (a final norm and an lm_head of 1e30): evaluate
    reports no score and writes no file, generate samples no token (greedy or not), and
    --perplexity gives no perplexity: each one line, exit 2."""
    from llama_ddp.generate import main as generate
    from llama_ddp.interop.native import save_model

    model = load_model(out)
    with torch.no_grad():
        model.base_model.norm.weight.fill_(1e30)
        model.lm_head.weight.fill_(1e30)
    folder = tmp_path / "m"
    save_model(model, model.config, folder, out / "tokenizer.json")
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a b", "choices": ["c", "d"], "label": 0}\n' * 3)
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x\n")
    scores = tmp_path / "scores.json"
    commands = {
        "its log-likelihoods on task are not finite, so it has no score": lambda: main(
            ["--model", str(folder), "--tasks", str(task), "--output", str(scores)]
        ),
        "the model's logits are not finite": lambda: generate(
            ["--model", str(folder), "--prompt", "def", "--max-new-tokens", "3"]
        ),
        "sample from": lambda: generate(
            ["--model", str(folder), "--prompt", "def", "--temperature", "0"]
        ),
        "so it has no perplexity": lambda: generate(
            ["--model", str(folder), "--perplexity", str(text)]
        ),
    }
    for said, command in commands.items():
        assert command() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert not scores.exists()


def test_init_from_weights_that_are_not_finite_is_one_line_before_training(
    out, train_env, tmp_path
):
    from tests.helpers.runs import train_here

    native = _poisoned(out, tmp_path, float("nan"))[0]
    corpus = str(train_env["corpus"])
    args = ["--init-from", str(native), "--tokenizer", str(native), "--dataset", corpus,
            "--max-steps", "2", "--out-dir", str(tmp_path / "train")]  # fmt: skip
    result = train_here(train_env, args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "its weights are not finite" in result.stderr
    assert "learning rate" not in result.stderr
    assert not (tmp_path / "train" / "checkpoints").exists()
