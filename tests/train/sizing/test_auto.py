"""train/sizing/auto.py, --model-size from the command line and TOML: the learning rate that
goes with a member, the refusals, auto end to end in one process (its choice, the banner, the
corpus note, a resume that keeps the size) and under torchrun (DDP and FSDP: rank 0 chooses,
every rank takes it)."""

import json
import re

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.model import family
from llama_ddp.train.cli import parse_train_args
from tests.helpers.runs import load_weights, runs_in_one_torchrun, tiny_args, train_here
from tests.train.budget.test_budget import RunClock


def settled_lr(*flags: str) -> float:
    return parse_train_args(list(flags)).settle().optim.lr


def test_a_member_trains_at_its_optimizers_lr_scaled_by_its_width():
    assert settled_lr("--model-size", "1") == pytest.approx(1.6e-2)  # 4e-3 x 256 / 64
    assert settled_lr("--model-size", "4") == pytest.approx(4e-3)
    assert settled_lr("--model-size", "16") == pytest.approx(1e-3)
    assert settled_lr("--model-size", "1", "--optimizer", "adamw") == pytest.approx(4e-3)
    assert settled_lr("--model-size", "1", "--lr", "1e-3") == 1e-3  # --lr wins
    assert settled_lr("--model-size", "1", "--hidden-size", "256") == pytest.approx(4e-3)
    assert settled_lr("--preset", "tiny") == settled_lr() == 4e-3  # presets: as before


def test_the_toml_key_names_a_member_or_auto(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("model-size = 3\n")
    cfg = parse_train_args(["--config", str(toml)])
    assert cfg.model.model_size == "3" and cfg.model_config(300).hidden_size == 192
    toml.write_text('[model]\nmodel-size = "auto"\n[schedule]\ntime-budget = "90s"\n')
    assert parse_train_args(["--config", str(toml)]).model.model_size == "auto"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model-size", "auto"], r"--model-size auto chooses the size that learns most in the "
         r"time given, and no time is given \(add --time-budget, e\.g\. 10m, or give a depth: "
         r"--model-size 4\)"),
        (["--model-size", "0"], r"--model-size 0 is not a depth from 1 to 64 \(give one"),
        (["--model-size", "big"], r"--model-size 'big' is neither auto nor a depth"),
        (["--model-size", "2", "--preset", "tiny"], r"--model-size 2 and --preset tiny both name"),
        (["--model-size", "auto", "--time-budget", "1m", "--hidden-size", "96"],
         r"--model-size auto derives the model's hidden_size from the size it chooses \(drop "
         r"--hidden-size, or give a depth: --model-size 4\)"),
        (["--model-size", "auto", "--time-budget", "1m", "--init-from", "x"],
         r"--model-size auto and --init-from x both set the model's shape"),
    ],
)  # fmt: skip
def test_refusals(flags, message):
    with pytest.raises(UserError, match=message):
        parse_train_args(flags)


@pytest.mark.parametrize("size", ["²", "٣", "3٣", " 3", "3 ", "+3", "3.0", "0x3", "", "auto3"])
def test_a_size_is_ascii_digits_or_auto(size):
    """str.isdigit takes superscripts (int() then raises ValueError) and other scripts' digits
    (int("٣") is 3): a size is written in ASCII digits."""
    with pytest.raises(UserError, match=r"--model-size .* is neither auto nor a depth \(give a "
                       r"number of layers from 1 to 64, or auto with --time-budget\)"):  # fmt: skip
        parse_train_args(["--model-size", size])


@pytest.mark.parametrize("size", ["0", "65", "007" + "0"])
def test_a_depth_outside_the_family_is_refused(size):
    with pytest.raises(UserError, match=rf"--model-size {int(size)} is not a depth from 1 to 64"):
        parse_train_args(["--model-size", size])


def test_ascii_depths_still_parse():
    assert parse_train_args(["--model-size", "03"]).model_config(300).num_hidden_layers == 3


@pytest.mark.e2e
def test_a_superscript_size_is_one_line_and_exit_2(train_env, tmp_path):
    args = tiny_args(train_env, tmp_path / "out")
    at = args.index("--preset")
    result = train_here(train_env, [*args[:at], *args[at + 2 :], "--model-size", "²"])
    assert result.returncode == 2 and result.stdout == ""
    assert re.fullmatch(r"error: --model-size '²' is neither auto nor a depth [^\n]*\n",
                        result.stderr)  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_auto_without_a_budget_is_one_line_and_exit_2_before_anything_is_written(
    train_env, tmp_path
):
    args = tiny_args(train_env, tmp_path / "out")
    at = args.index("--preset")
    result = train_here(train_env, [*args[:at], *args[at + 2 :], "--model-size", "auto"])
    assert result.returncode == 2 and result.stdout == ""
    assert re.fullmatch(r"error: --model-size auto chooses [^\n]*\(add --time-budget[^\n]*\)\n",
                        result.stderr)  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.fixture
def auto_run(train_env, tmp_path, monkeypatch, capsys):
    """run(cfg) with --model-size auto and a budget on a `RunClock` (1 s a step after 2 s of
    start-up; the candidates' steps run, but take 0.02 x depth^2 s by that clock): (exit
    code, stdout, the model's config)."""
    from llama_ddp.train import run as run_module
    from llama_ddp.train.budget import budget as budget_module
    from llama_ddp.train.sizing import auto as sizing

    monkeypatch.setattr(run_module, "process_age", lambda: 2.0)
    monkeypatch.setattr(sizing, "process_age", lambda: 2.0)
    timed = sizing._time_steps

    def time_steps(cfg, *args):  # its steps run, its seconds a fake machine's, as the budget's
        timed(cfg, *args)
        return 0.02 * cfg.model.depth() ** 2

    monkeypatch.setattr(sizing, "_time_steps", time_steps)

    def train(*flags: str, out=tmp_path):
        clock = RunClock(1.0)
        monkeypatch.setattr(budget_module, "CLOCK", clock)
        args = tiny_args(train_env, out, "--eval-tokens", "768", "--lr-schedule", "wsd",
                         "--optimizer", "muon")  # fmt: skip
        at, steps = args.index("--preset"), args.index("--max-steps")
        args = [*args[:at], *args[at + 2 : steps], *args[steps + 2 :], *flags]
        cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
        code = run_module.run(cfg, fault=clock.hook)
        return code, capsys.readouterr().out, json.loads((out / "llama_model.json").read_text())

    return train


@pytest.mark.e2e
def test_auto_times_candidates_trains_the_best_and_a_resume_keeps_it(auto_run, tmp_path):
    """auto's run is the run of the depth it names, bit for bit (its timing draws nothing from
    the run's seed or data position); run again, it keeps that depth and times nothing."""
    code, out, config = auto_run("--model-size", "auto", "--time-budget", "40s")
    assert code == 0, out[-2000:]
    chosen = re.search(r"model size: auto chose depth (\d+) \((\S+)M parameters, .*; "
                       r"(\S+)M tokens in (\d+) steps, (\S+) tokens per parameter, .*"
                       r"predicted val bpb (\S+)\); runner-up: depth (\d+)", out)  # fmt: skip
    assert chosen, out[:3000]
    depth, runner_up = int(chosen[1]), int(chosen[7])
    assert family.depth_of(config) == depth != runner_up
    timed = re.search(r"a step timed of each candidate \(([^)]*)\) took (\S+) s", out)
    assert f"d{depth} " in timed[1] and f"d{runner_up} " in timed[1]
    # the planned steps repeat the 25k tokens of the corpus: said
    assert re.search(r"note: the corpus holds 0\.0\dM tokens a pass, fewer than the", out)
    assert "optimizer: muon, peak lr " + f"{4e-3 * family.lr_scale(64 * depth):g}" in out
    fixed = tmp_path / "fixed"
    code, _, _ = auto_run("--model-size", str(depth), "--time-budget", "40s", out=fixed)
    ours, theirs = load_weights(tmp_path), load_weights(fixed)
    assert code == 0 and ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    code, out, again = auto_run("--model-size", "auto", "--time-budget", "60s")
    assert code == 0 and again == config and "a step timed" not in out
    assert f"model size: depth {depth} (" in out and "kept from the checkpoint" in out


@pytest.mark.e2e
def test_a_resume_keeps_every_shape_flag_auto_takes(auto_run):
    """--max-position-embeddings (and --rope-theta, --tie-embeddings) are flags auto takes: a
    checkpoint made with them is still of the family's member (the resume compared the member's
    2048 positions and refused it as "a model outside the family")."""
    flags = ("--model-size", "auto", "--time-budget", "40s", "--max-position-embeddings", "512",
             "--rope-theta", "20000", "--tie-embeddings")  # fmt: skip
    code, out, config = auto_run(*flags)
    assert code == 0, out[-2000:]
    assert config["max_position_embeddings"] == 512 and config["tie_word_embeddings"]
    depth = int(re.search(r"model size: auto chose depth (\d+)", out)[1])
    code, out, again = auto_run(*flags[:3], "60s", *flags[4:])
    assert code == 0 and again == config and "a step timed" not in out
    assert f"model size: depth {depth} (" in out and "kept from the checkpoint" in out


@pytest.mark.e2e
def test_auto_refuses_a_checkpoint_of_a_preset(auto_run, train_env, tmp_path):
    result = train_here(train_env, tiny_args(train_env, tmp_path, "--max-steps", "2"))
    assert result.returncode == 0
    with pytest.raises(UserError, match=r"the checkpoint .* is of a model outside the family"):
        auto_run("--model-size", "auto", "--time-budget", "40s")


@pytest.mark.e2e
@pytest.mark.alone
def test_under_torchrun_rank_0_chooses_and_every_rank_trains_it(train_env, tmp_path):
    """FSDP x2 (gloo): the candidates are timed by both ranks together (a rank that timed or
    built another size would leave a collective unmatched: each FSDP layer gathers its weights
    from both), rank 0 prints the choice, and both train, save and export it. DDP x2's choice,
    shared and trained by both ranks: test_auto_timing.py's out-of-memory test."""
    runs = {}
    for mode, budget in (("fsdp", "30s"),):
        args = tiny_args(train_env, tmp_path / mode, "--mode", mode, "--lr-schedule", "wsd")
        at, steps = args.index("--preset"), args.index("--max-steps")
        runs[mode] = [*args[:at], *args[at + 2 : steps], *args[steps + 2 :],
                      "--model-size", "auto", "--time-budget", budget]  # fmt: skip
    results = runs_in_one_torchrun(train_env, tmp_path / "launch", runs)
    for mode, result in results.items():
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        depth = int(re.search(r"model size: auto chose depth (\d+)", result.stdout)[1])
        config = json.loads((tmp_path / mode / "llama_model.json").read_text())
        assert family.depth_of(config) == depth
        rank1 = (tmp_path / "launch" / f"{mode}.rank1.stdout").read_text()
        assert "model size" not in rank1
