"""Bad input: one line `error: ...`, exit code 2, no traceback, nothing on disk changed."""

import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from llama_ddp.data.tokenizer import train_tokenizer
from llama_ddp.data.tokenizer_files import save_tokenizer
from llama_ddp.errors import UserError
from llama_ddp.train.cli import build_parser, main, parse_train_args, tomllib
from tests.helpers.runs import ROOT, run_train, tiny_args, train_here


def snapshot(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"  # the lock records its holder: not the run's data
    }


@pytest.fixture(scope="module")
def trained(train_env, tmp_path_factory):
    """A finished tiny run: its folder must survive every failed run pointed at it."""
    out = tmp_path_factory.mktemp("trained")
    result = train_here(train_env, tiny_args(train_env, out, "--max-steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def inputs(train_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text((json.dumps({"text": ""}) + "\n") * 50)
    (root / "a_file").write_text("x")
    good = (root / "blank.jsonl").read_text().replace('""', '"words"')
    (root / "not_json.jsonl").write_text("not json\n" + good)
    (root / "not_utf8.txt").write_bytes(b"paragraph\n\n" * 100 + b"\xff\xfe\n")
    (root / "cut.jsonl.gz").write_bytes(gzip.compress(good.encode() * 40)[:-100])
    (root / "open_quote.csv").write_text('text\n"a"\n"b\nc\n' + "d\n" * 10)
    docs = ["the cat runs over the red house and the dog jumps"] * 50
    save_tokenizer(train_tokenizer(docs, 290), root / "other_tokenizer.json")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=280, special_tokens=["[BOT]"]))
    plain.save(str(root / "no_specials.json"))
    remapped = root / "remapped"  # the run's tokenizer, padding with [EOT]
    remapped.mkdir()
    shutil.copy(train_env["tokenizer"], remapped / "tokenizer.json")
    roles = {"bos_token": "[BOT]", "eos_token": "[EOT]", "pad_token": "[EOT]"}
    (remapped / "tokenizer_config.json").write_text(json.dumps(roles))
    return root


CASES = {
    "missing dataset path": (["--dataset", "{inputs}/nope.jsonl"], "nope.jsonl"),
    "glob matching nothing": (["--dataset", "{inputs}/nope/*.jsonl"], "nope/*.jsonl"),
    "unknown hub dataset offline": (["--dataset", "nobody-here/no-such-dataset"], "offline"),
    "wrong text column": (["--text-column", "body"], "text"),
    "empty corpus": (["--dataset", "{inputs}/blank.jsonl"], "no non-empty documents"),
    "jsonl whose first line is not JSON": (
        ["--dataset", "{inputs}/not_json.jsonl"],
        "not_json.jsonl: line 1, column 1: not valid JSON",
    ),
    "txt with bytes that are not UTF-8": (
        ["--dataset", "{inputs}/not_utf8.txt"],
        "not_utf8.txt: byte 1,100 (line 201, column 1): 0xff is not UTF-8",
    ),
    "truncated jsonl.gz": (["--dataset", "{inputs}/cut.jsonl.gz"], "cut.jsonl.gz: the file is"),
    "csv with an unclosed quote": (
        ["--dataset", "{inputs}/open_quote.csv"],
        "open_quote.csv: line 3: a quoted field opens in this row and is never closed",
    ),
    "missing tokenizer": (["--tokenizer", "{inputs}/nope.json"], "not found"),
    "tokenizer lacking a special token": (["--tokenizer", "{inputs}/no_specials.json"], "[EOT]"),
    "seq length above positions": (["--seq-length", "300"], "max_position_embeddings"),
    "batch does not divide": (["--micro-batch-size", "3"], "not a multiple"),
    "invalid model shape": (["--hidden-size", "66"], "does not divide hidden_size=66"),
    "ddp without torchrun": (["--mode", "ddp"], "needs torchrun"),
    "cuda without a GPU": (["--device", "cuda"], "no CUDA GPU"),
    "resume with another shape": (["--hidden-size", "128"], "different model shape"),
    "resume with another document mask": (["--no-document-mask"], "different document mask"),
    "resume with another tokenizer": (
        ["--tokenizer", "{inputs}/other_tokenizer.json"],
        "different tokenizer",
    ),
    "resume with other special tokens": (
        ["--tokenizer", "{inputs}/remapped"],
        "different special tokens (pad [PAD] vs [EOT])",
    ),
    "unwritable out dir": (["--out-dir", "{inputs}/a_file/out"], "not writable"),
    "unknown flag": (["--frobnicate", "3"], "unrecognized arguments: --frobnicate"),
    "unknown preset": (["--preset", "huge"], "invalid choice: 'huge'"),
    "resume with another optimizer": (
        ["--optimizer", "muon"],
        "a different optimizer (adamw vs muon now)",
    ),
    "eval budget not a number": (
        ["--eval-tokens", "many"],
        "--eval-tokens must be a positive number or `all`, got 'many'",
    ),
    "fresh run over saved checkpoints": (["--resume", "none"], "already holds checkpoints"),
    "negative steps": (["--max-steps", "-1"], "--max-steps must be positive"),
    "missing config file": (["--config", "{inputs}/nope.toml"], "not found"),
    "resume from a missing checkpoint": (["--resume", "{inputs}/nope"], "not found"),
    "learning rate not a number": (["--lr", "nan"], "--lr must be a finite number"),
    "learning rate that overflows float32": (
        ["--lr", "1e308", "--min-lr", "0"],
        "--lr 1e+308 does not fit a float32",
    ),
    "learning rate that overflows the step": (
        ["--lr", "1e37", "--min-lr", "0"],
        "--lr 1e+37 overflows a float32 in the optimizer's step",
    ),
    "profiling past the last step": (
        ["--profile-steps", "9:12"],
        "--profile-steps 9:12 starts past the run's last step 8",
    ),
    "a negative profile step": (["--profile-steps", "-1:2"], "--profile-steps '-1:2' is not A:B"),
    "max steps below the checkpoint's step": (
        ["--max-steps", "1"],
        "is at step 2, past --max-steps 1 (give a larger --max-steps, or a new --out-dir",
    ),
    "beta outside [0, 1)": (["--beta1", "2"], "--beta1 must be in [0, 1)"),
    "negative weight decay": (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    "negative clipping": (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    "resume with another seq length": (["--seq-length", "32"], "a different seq length (48 vs 32"),
    "resume with another global batch": (["--batch-size", "16"], "a different batch size (8 vs 16"),
    "resume with another data order": (["--seed", "7"], "a different seed"),
    "out dir is a file": (["--out-dir", "{inputs}/a_file"], "is a file, not a folder"),
    "dp with compile": (["--mode", "dp", "--compile"], "--compile does not work with --mode dp"),
    "a role that is no special token": (
        ["--eot-token", "the"],
        "--eot-token 'the' is not a special",
    ),
    "resume untied as tied": (
        ["--tie-embeddings"],
        "model shape (tie_word_embeddings None vs True)",
    ),
}


# These run as train.py processes, as a user runs them (a flag, the data stage, the resume
# stage); the others run its `cli.main` in this process (conftest.train_here), at a
# fraction of the start-up cost.
AS_A_PROCESS = {"unknown flag", "missing dataset path", "resume with another shape"}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, trained, inputs, train_env):
    extra, expected = CASES[case]
    extra = [a.replace("{inputs}", str(inputs)) for a in extra]
    before = snapshot(trained)
    args = [*tiny_args(train_env, trained), *extra]
    result = (run_train if case in AS_A_PROCESS else train_here)(train_env, args)
    code, out, err = result.returncode, result.stdout, result.stderr
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]
    assert "Traceback" not in err + out
    assert snapshot(trained) == before


@pytest.mark.e2e
def test_flags_are_checked_before_any_data_is_read(train_env, tmp_path):
    args = tiny_args(train_env, tmp_path, "--dataset", str(tmp_path / "absent.jsonl"))
    result = train_here(train_env, [*args, "--lr", "inf", "--seq-length", "999"])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --lr must be a finite number, got inf"


def test_python_m_llama_ddp_train_is_the_train_command():
    done = subprocess.run(
        [sys.executable, "-m", "llama_ddp.train", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m llama_ddp.train ")
    assert "--seq-length" in done.stdout and "--eval-tasks" in done.stdout


def test_the_console_entry_point_names_itself(monkeypatch, capsys):
    from llama_ddp.train.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["/usr/bin/llama-ddp-train"])
    assert build_parser().format_usage().startswith("usage: llama-ddp-train ")


@pytest.mark.e2e
def test_debug_shows_the_traceback(train_env, trained):
    result = run_train(train_env, [*tiny_args(train_env, trained), "--mode", "ddp", "--debug"])
    assert result.returncode != 0
    assert "Traceback" in result.stderr


class CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.e2e
def test_a_pickle_that_runs_code_is_refused(trained, tmp_path, train_env):
    evidence = tmp_path / "pwned"
    payload = pickle.dumps({"weights": CreatesAFile(evidence)}, protocol=2)
    # As a training checkpoint's DCP metadata (a pickle): a copy whose manifest matches it.
    ckpt = tmp_path / "step-00000002"
    shutil.copytree(trained / "checkpoints" / "step-00000002", ckpt)
    (ckpt / ".metadata").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    result = train_here(train_env, [*tiny_args(train_env, tmp_path / "out"), "--resume", str(ckpt)])
    assert result.returncode == 2 and "refused without running it" in result.stderr
    assert not evidence.exists()
    # As llama_model.pth, loaded for inference.
    model_dir = tmp_path / "model"
    shutil.copytree(trained, model_dir)
    (model_dir / "llama_model.pth").write_bytes(payload)
    from llama_ddp.interop.load import load_model

    with pytest.raises(UserError, match="refused without running it"):
        load_model(model_dir / "llama_model.pth")
    assert not evidence.exists()


@pytest.mark.e2e
def test_a_checkpoint_of_the_old_format_is_refused_clearly(trained, tmp_path, train_env):
    old = tmp_path / "step-00000002"
    old.mkdir()
    for name in ("model.pt", "optimizer.pt", "rng.pt", "state.json"):
        (old / name).write_bytes(b"x")
    files = {n: {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()} for n in os.listdir(old)}
    (old / "manifest.json").write_text(json.dumps({"step": 2, "files": files}))
    result = train_here(train_env, [*tiny_args(train_env, tmp_path / "out"), "--resume", str(old)])
    assert result.returncode == 2, result.stderr
    assert "checkpoint format 1 by an older llama_ddp" in result.stderr


def test_toml_config_and_flags_override_it(tmp_path):
    (tmp_path / "run.toml").write_text(
        'preset = "tiny"\nseq-length = 64\nlr = 3e-4\ncompile = true\neval-tokens = 4096\n'
    )
    cfg = parse_train_args(["--config", str(tmp_path / "run.toml"), "--seq-length", "32"])
    assert (cfg.model.preset, cfg.data.seq_length, cfg.optim.lr, cfg.runtime.compile) == (
        "tiny",
        32,
        3e-4,
        True,
    )
    assert cfg.eval.budget() == 4096  # a number in TOML, a number or `all` on the command line
    (tmp_path / "bad.toml").write_text("sequence_length = 64\n")
    with pytest.raises(UserError, match="unknown key 'sequence_length'"):
        parse_train_args(["--config", str(tmp_path / "bad.toml")])


def test_a_toml_file_may_group_its_settings_by_component(tmp_path):
    (tmp_path / "run.toml").write_text(
        "lr = 3e-4\n[data]\nseq-length = 64\nbatch_size = 8\n[runtime]\nseed = 7\n"
    )
    cfg = parse_train_args(["--config", str(tmp_path / "run.toml")])
    assert (cfg.optim.lr, cfg.data.seq_length, cfg.data.batch_size, cfg.runtime.seed) == (
        3e-4,
        64,
        8,
        7,
    )
    (tmp_path / "bad.toml").write_text("[data]\nlr = 3e-4\n")
    with pytest.raises(UserError, match=r"'lr' in \[data\] of .*bad.toml is a setting of \[optim"):
        parse_train_args(["--config", str(tmp_path / "bad.toml")])
    (tmp_path / "bad.toml").write_text("[data]\nfoo = 1\n")
    with pytest.raises(UserError, match=r"unknown key 'foo' in \[data\] of .*bad.toml"):
        parse_train_args(["--config", str(tmp_path / "bad.toml")])


TABLES = "[model], [data], [optim], [schedule], [runtime], [checkpoint], [eval], [output]"
TOML_MISTAKES = {
    "a setting at the top and in its table": (
        "seq-length = 32\n[data]\nseq-length = 128\n",
        "seq-length is given twice in {p}: as 'seq-length' at the top and as 'seq-length' under "
        "[data] (keep one)",
    ),
    "two spellings in one table": (
        "[data]\nseq-length = 32\nseq_length = 128\n",
        "seq-length is given twice in {p}: as 'seq-length' under [data] and as 'seq_length' under "
        "[data] (keep one)",
    ),
    "two spellings at the top": (
        "max_steps = 3\nmax-steps = 4\n",
        "max-steps is given twice in {p}: as 'max_steps' at the top and as 'max-steps' at the top",
    ),
    "dataset beside [[sources]]": (
        'dataset = "sample"\n[[sources]]\ndataset = "sample"\n',
        "{p} names its data twice: dataset (as 'dataset' at the top) and [[sources]] tables "
        "(keep one",
    ),
    "dataset in [data] beside [[sources]]": (
        '[data]\ndataset = ["sample"]\n\n[[sources]]\ndataset = "sample"\n',
        "{p} names its data twice: dataset (as 'dataset' under [data])",
    ),
    "a setting in another component's table": (
        "[model]\nseq-length = 32\n",
        "'seq-length' in [model] of {p} is a setting of [data] (move it there, or to the top)",
    ),
    "a table that is no component": (
        "[optimizer]\nlr = 0.1\n",
        f"[optimizer] in {{p}} is not a table of settings (use one of {TABLES}, or give the keys "
        "at the top, without a table)",
    ),
    "an overflowing learning rate": (
        "[optim]\nlr = 1e308\n[schedule]\nmin-lr = 0\n",
        "--lr 1e+308 does not fit a float32",
    ),
}


@pytest.mark.parametrize("case", list(TOML_MISTAKES))
def test_a_toml_mistake_is_one_line_naming_both_places(case, tmp_path, capsys):
    """Each is refused before any work, through train.py's main: one line, exit 2."""
    text, expected = TOML_MISTAKES[case]
    p = tmp_path / "run.toml"
    p.write_text(text)
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + expected.format(p=p)) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        # issue 52: "drop --max-steps", a flag the user never gave
        ("max-steps = 500\n", ["--time-budget", "10m"], "drop max-steps from {p}"),
        ("[schedule]\nepochs = 2\n", ["--time-budget", "10m"], "drop epochs from {p}"),
        ('time-budget = "10m"\nmax-steps = 5\n', [], "drop max-steps from {p}"),
        ('time-budget = "10m"\n', ["--max-steps", "5"], "drop --max-steps"),
    ],
)
def test_a_length_beside_a_time_budget_is_refused_naming_where_each_is(
    text, flags, expected, tmp_path, capsys
):
    p = tmp_path / "run.toml"
    p.write_text(text)
    assert main(["--config", str(p), *flags]) == 2
    budget = "--time-budget" if flags[:1] == ["--time-budget"] else f"time-budget in {p}"
    err = capsys.readouterr().err
    assert err == f"error: {budget} plans the run's length: {expected.format(p=p)}\n"


def test_a_dataset_flag_still_replaces_the_files_sources(tmp_path):
    (tmp_path / "run.toml").write_text('[[sources]]\ndataset = "a.jsonl"\n')
    cfg = parse_train_args(["--config", str(tmp_path / "run.toml"), "--dataset", "sample"])
    assert (cfg.data.dataset, cfg.data.sources) == (("sample",), ())


def test_pyproject_declares_the_toml_reader_python_3_10_imports():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tomli = [r for r in map(Requirement, project["dependencies"]) if r.name == "tomli"]
    assert len(tomli) == 1, project["dependencies"]
    assert tomli[0].marker.evaluate({"python_version": "3.10"})
    assert not tomli[0].marker.evaluate({"python_version": "3.11"})
    assert project["requires-python"] == ">=3.10"


@pytest.mark.e2e
def test_help_lists_flags_with_their_docs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--micro-batch-size" in result.stdout
    assert "global batch in sequences per optimizer step" in result.stdout
    assert "--packing {pack,pad}" in result.stdout  # choices come from the field's Literal type
    assert "data settings:" in result.stdout  # one group per component
    from llama_ddp.train.config import FLAGS

    assert all(len(f.field.metadata["help"]) > 10 for f in FLAGS.values())  # every flag says what


# train.py's flags before the settings were split by component (issue 41), in --help's order.
FLAGS_OF_BEFORE = """--config --debug --init-from --preset --hidden-size --intermediate-size
--num-hidden-layers --num-attention-heads --num-key-value-heads --max-position-embeddings
--rope-theta --tie-embeddings --dataset --dataset-weights --dataset-config --split --text-column
--streaming --val-fraction --tokenizer --vocab-size --bot-token --eot-token --pad-token
--seq-length --packing --document-mask --cache-dir --num-workers --num-proc --batch-size
--micro-batch-size --epochs --max-steps --optimizer --lr --min-lr --warmup-steps --lr-schedule
--decay-fraction --weight-decay --beta1 --beta2 --grad-clip --mode --device --dtype --compile
--activation-checkpointing --seed --out-dir --save-every --keep-last --resume --eval-every
--eval-tokens --eval-tasks --eval-limit --log-every --log-to --profile-steps --peak-tflops
--export-hf --export-gguf""".split()
FLAGS_SINCE = ["--time-budget", "--attention", "--model-size"]  # issues 46, 45, 54


def test_help_offers_every_flag_of_before_and_no_other():
    parser = build_parser("train.py")
    offered = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    negated = {f"--no-{flag[2:]}" for flag in FLAGS_OF_BEFORE} | {"--help"}
    assert sorted(f for f in offered if f not in negated) == sorted(FLAGS_OF_BEFORE + FLAGS_SINCE)


def test_an_old_flat_toml_file_still_configures_every_component(tmp_path):
    """A user's TOML file of before the components: flat keys, dashes or underscores, every
    kind of value, [[sources]] tables."""
    (tmp_path / "old.toml").write_text(
        'preset = "tiny"\nnum-hidden-layers = 3\ntie_embeddings = true\nseq-length = 64\n'
        'packing = "pad"\nbatch_size = 8\nmicro-batch-size = 4\nmax-steps = 20\n'
        'optimizer = "adamw"\nlr = 3e-4\nmin_lr = 1e-5\nlr-schedule = "wsd"\nbeta2 = 0.95\n'
        'dtype = "fp32"\nseed = 7\nout-dir = "runs/a"\nkeep-last = 3\nresume = "none"\n'
        'eval-every = 5\neval-tokens = "all"\nlog-every = 2\nexport-hf = false\n'
        '[[sources]]\ndataset = "sample"\nweight = 2.0\n'
    )
    cfg = parse_train_args(["--config", str(tmp_path / "old.toml")])
    assert (cfg.model.preset, cfg.model.num_hidden_layers, cfg.model.tie_embeddings) == (
        "tiny",
        3,
        True,
    )
    data = cfg.data
    assert (data.seq_length, data.packing, data.batch_size, data.micro_batch_size) == (
        64,
        "pad",
        8,
        4,
    )
    assert data.sources == ({"dataset": "sample", "weight": 2.0},)
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.beta2) == ("adamw", 3e-4, 0.95)
    assert (cfg.schedule.max_steps, cfg.schedule.min_lr, cfg.schedule.lr_schedule) == (
        20,
        1e-5,
        "wsd",
    )
    assert (cfg.runtime.dtype, cfg.runtime.seed) == ("fp32", 7)
    assert (cfg.checkpoint.out_dir, cfg.checkpoint.keep_last, cfg.checkpoint.resume) == (
        "runs/a",
        3,
        "none",
    )
    assert (cfg.eval.eval_every, cfg.eval.budget()) == (5, None)
    assert (cfg.output.log_every, cfg.output.export_hf) == (2, False)


def test_log_to_and_schedule_flags_are_checked_before_any_work(monkeypatch):
    assert parse_train_args(["--log-to", "none"]).output.loggers() == []
    find_spec = importlib.util.find_spec
    # The list is parsed the same whether or not the packages are installed (CI has no wandb).
    installed = {"wandb", "tensorboard"}
    with monkeypatch.context() as patch:
        patch.setattr(
            importlib.util,
            "find_spec",
            lambda name: object() if name in installed else find_spec(name),
        )
        assert parse_train_args(["--log-to", "wandb, tensorboard,wandb"]).output.loggers() == [
            "wandb",
            "tensorboard",
        ]
    with pytest.raises(UserError, match="--log-to 'mlflow' is not one of: tensorboard, wandb"):
        parse_train_args(["--log-to", "tensorboard,mlflow"])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name)
    )
    with pytest.raises(UserError) as err:
        parse_train_args(["--log-to", "wandb"])
    assert (
        str(err.value) == "--log-to wandb needs the wandb package (pip install 'llama_ddp[wandb]')"
    )
    with pytest.raises(UserError, match=r"--decay-fraction must be in \(0, 1\], got 1.5"):
        parse_train_args(["--lr-schedule", "wsd", "--decay-fraction", "1.5"])
    with pytest.raises(UserError, match="invalid choice: 'step'"):
        parse_train_args(["--lr-schedule", "step"])


MIXTURE_MISTAKES = {
    "weights that do not match the sources": (
        ["--dataset", "{a}", "--dataset", "{b}", "--dataset-weights", "0.5"],
        "--dataset-weights gives 1 weight(s) for 2 --dataset source(s)",
    ),
    "a zero weight": (
        ["--dataset", "{a}", "--dataset", "{b}", "--dataset-weights", "1,0"],
        "source 'b' has weight 0.0; weights must be positive",
    ),
    "a negative weight in a table": (["--config", "{negative}"], "has weight -1.0"),
    "an unknown key in a [[sources]] table": (
        ["--config", "{typo}"],
        "[[sources]] table 2 has unknown key 'wieght'",
    ),
    "an empty source": (["--dataset", "{a}", "--dataset", "{blank}"], "no non-empty documents"),
    "a source without the text column": (
        ["--dataset", "{a}", "--dataset", "{body}"],
        "has no text column 'text'; its columns are body",
    ),
    "two sources of one name": (
        ["--dataset", "{a}", "--dataset", "{other}"],
        "two sources are named 'a'",
    ),
}


@pytest.mark.parametrize("case", list(MIXTURE_MISTAKES))
def test_mixture_mistakes_are_one_line_before_any_tokenization(case, train_env, tmp_path, capsys):
    root = tmp_path / "data"
    (root / "other").mkdir(parents=True)
    docs = train_env["corpus"].read_text()
    paths = {"a": root / "a.jsonl", "b": root / "b.jsonl", "other": root / "other" / "a.jsonl"}
    for path in paths.values():
        path.write_text(docs)
    paths["blank"] = root / "blank.jsonl"
    paths["blank"].write_text((json.dumps({"text": ""}) + "\n") * 20)
    paths["body"] = root / "body.jsonl"
    paths["body"].write_text(json.dumps({"body": "some text"}) + "\n")
    table = f'[[sources]]\ndataset = "{paths["a"]}"\n'
    paths["negative"] = root / "negative.toml"
    paths["negative"].write_text(table + "weight = -1\n")
    paths["typo"] = root / "typo.toml"
    paths["typo"].write_text(f'{table}[[sources]]\ndataset = "{paths["b"]}"\nwieght = 2\n')
    extra, expected = MIXTURE_MISTAKES[case]
    extra = [a.format(**paths) for a in extra]
    cache = tmp_path / "cache"
    args = [*tiny_args(train_env, tmp_path / "out", *extra), "--cache-dir", str(cache)]
    if "--config" in extra:  # the tables are the sources: no --dataset flag to replace them
        i = args.index("--dataset")
        del args[i : i + 2]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not list(cache.glob("tokens-*")) and "Traceback" not in out + err


def test_help_says_each_default_once():
    parser = build_parser("train.py")
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.help}
    assert [flag for flag, text in helps.items() if text.count("default:") > 1] == []
    assert helps["--num-attention-heads"] == "query heads (default: the preset's)"
    assert helps["--seed"].endswith("(default: 1337)")


@pytest.mark.parametrize(
    "out_dir, expected",
    [
        ("", "error: --out-dir is empty, which would put the run's files in the current folder "
         "(give a folder, e.g. --out-dir out)"),
        ("  ", "error: --out-dir is empty, which would put the run's files in the current folder "
         "(give a folder, e.g. --out-dir out)"),
        ("runs/" + "a" * 300, "error: --out-dir has a name of 300 bytes ('aaaaaaaaaaaaaaaaaaaa"
         "...'), more than the 255 its filesystem allows (choose a shorter --out-dir)"),
    ],
)  # fmt: skip
def test_an_empty_or_too_long_out_dir_is_one_line_before_anything_is_written(
    out_dir, expected, train_env, tmp_path, monkeypatch
):
    """`--out-dir ""` (an unset variable in a script) wrote the whole run into the current
    folder; a name longer than the filesystem allows was a traceback (File name too long)."""
    monkeypatch.chdir(tmp_path)
    result = train_here(train_env, tiny_args(train_env, out_dir))
    assert (result.returncode, result.stderr.strip()) == (2, expected)
    assert list(tmp_path.iterdir()) == []
