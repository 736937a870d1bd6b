"""End-to-end training: equal weights across modes, the files a run writes, the schedule."""

import itertools
import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch

from llama_ddp.checkpoint.state import saved_setting
from llama_ddp.interop.native import CONFIG_FILE, MODEL_FILE
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.optim import lr_at
from llama_ddp.train.run import run
from tests.helpers.runs import (
    ROOT,
    WORDS,
    Forked,
    free_port,
    full_run_args,
    load_weights,
    max_diff,
    runs_in_one_torchrun,
    tiny_args,
    torchrun_argv,
    torchrun_main,
    train_command,
    train_here,
)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def two_nodes(
    args: list[str], envs: list[dict], forked: bool = False
) -> list[tuple[int, str, str]]:
    """train.py with ``args`` on two torchrun nodes of one process each, on this machine, node r
    in ``envs[r]``: each node's (exit code, stdout, stderr). The torchrun command, or with
    ``forked`` its launch as `run_torchrun` makes it (its agent and worker forked, no import of
    torch). A node still running after the timeout is stopped by its PID."""
    port = free_port()
    nodes = []
    try:
        for rank, env in enumerate(envs):
            torchrun = ["--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1"]
            torchrun += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
            if forked:
                command = torchrun_argv(torchrun, [str(ROOT / "train.py"), *args])
                nodes.append(Forked(torchrun_main, command, env))
                continue
            pipe = subprocess.PIPE
            command = train_command(args, torchrun)
            nodes.append(subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True))
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


# Pack mode masks documents by default; "pack-causal" is plain causal packing (one test uses it).
# The pad-mode runs tie the lm_head to the embedding: every mode must keep one matrix too.
PACKING_ARGS = {
    "pad": ["--packing", "pad", "--tie-embeddings"],
    "pack": ["--packing", "pack"],
    "pack-causal": ["--packing", "pack", "--no-document-mask"],
}


def val_loss(out_dir) -> float:
    """The run's last validation loss (every run evaluates at its end)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "val_loss" in line][-1]["val_loss"]


@pytest.fixture(scope="module", params=["pad", "pack"])
def reference(request, train_env, tmp_path_factory):
    """One process, no accumulation: the weights (and validation loss) every other mode must
    reproduce."""
    out = tmp_path_factory.mktemp(f"single-{request.param}")
    check(train_here(train_env, tiny_args(train_env, out, *PACKING_ARGS[request.param])))
    return PACKING_ARGS[request.param], load_weights(out), val_loss(out)


@pytest.mark.e2e
def test_gradient_accumulation_gives_the_same_weights(reference, train_env, tmp_path):
    packing_args, expected, _ = reference
    args = tiny_args(train_env, tmp_path, *packing_args, "--micro-batch-size", "2")
    check(train_here(train_env, args))
    assert max_diff(load_weights(tmp_path), expected) < 1e-5


@pytest.mark.e2e
def test_data_parallel_mode_gives_the_same_weights(reference, train_env, tmp_path):
    packing_args, expected, _ = reference
    args = tiny_args(train_env, tmp_path, *packing_args, "--mode", "dp")
    result = check(train_here(train_env, args))
    assert "running unwrapped" in result.stderr  # no GPUs here: said in one line
    assert max_diff(load_weights(tmp_path), expected) < 1e-5


def task_scores(weights: dict, out, task) -> dict:
    """The scores of ``task`` (a .jsonl file) for ``weights``, scored in this process."""
    from llama_ddp.data.tokenizer_files import read_tokenizer
    from llama_ddp.eval.scoring import TaskEvaluator
    from llama_ddp.eval.tasks import load_tasks, parse_tasks

    model = LlamaForPretraining(LlamaConfig.load(out / CONFIG_FILE))
    model.load_state_dict(weights)
    tokenizer, special = read_tokenizer(out)
    return TaskEvaluator(load_tasks(parse_tasks(str(task))), tokenizer, special.ids.bot)(model)


@pytest.fixture(scope="module")
def two_process_runs(train_env, tmp_path_factory) -> dict:
    """Every run over 2 processes that a test below compares with one process, in one torchrun
    launch (tests/helpers/torchrun_runs.py: torchrun's start paid once, not six times): name ->
    (its --out-dir, what it printed and its exit code). "<packing>-<mode>": micro 2 x 2 ranks x
    2 accumulation steps, scoring a task file at the end; pad mode also recomputes every layer
    in the backward (--activation-checkpointing). "muon-<mode>": Muon, micro 2 x 2 ranks x 2
    accumulation steps."""
    root = tmp_path_factory.mktemp("two-processes")
    task = root / "task.jsonl"
    lines = [
        {"context": " ".join(WORDS[i : i + 5]), "choices": WORDS[i + 5 : i + 9]} for i in range(9)
    ]
    task.write_text("".join(json.dumps({**x, "label": i % 4}) + "\n" for i, x in enumerate(lines)))
    runs = {}
    for packing, mode in [
        ("pad", "ddp"),
        ("pad", "fsdp"),
        ("pack", "fsdp"),
        ("pack-causal", "ddp"),
    ]:
        args = tiny_args(train_env, root / f"{packing}-{mode}", *PACKING_ARGS[packing])
        args += ["--micro-batch-size", "2", "--mode", mode, "--eval-tasks", str(task)]
        checkpointing = ["--activation-checkpointing"] if packing == "pad" else []
        runs[f"{packing}-{mode}"] = [*args, *checkpointing]
    for mode in ("ddp", "fsdp"):
        args = tiny_args(train_env, root / f"muon-{mode}", "--optimizer", "muon", "--mode", mode)
        runs[f"muon-{mode}"] = [*args, "--micro-batch-size", "2"]
    results = runs_in_one_torchrun(train_env, root / "launch", runs)
    return {name: (root / name, result) for name, result in results.items()}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "reference, mode", [("pad", "ddp"), ("pad", "fsdp"), ("pack", "fsdp")], indirect=["reference"]
)  # pack under DDP: test_two_node_torchrun_gives_the_same_weights
def test_two_processes_give_the_same_weights(mode, reference, two_process_runs):
    """DDP and FSDP2 over 2 processes, micro 2 x 2 ranks x 2 accumulation steps: gradients are
    reduced once per optimizer step. Pad mode also recomputes every layer in the backward
    (--activation-checkpointing), which must not change a bit of the result. The run also
    scores a task, shared out over the ranks: the scores of the same weights in one process."""
    two_processes_match_one(mode, reference, two_process_runs)


def two_processes_match_one(mode, reference, two_process_runs) -> Path:
    """`mode`'s run over 2 processes (`two_process_runs`) gives the weights, validation loss and
    task scores of `reference`'s single process (test_two_processes_give_the_same_weights);
    the run's --out-dir."""
    packing_args, expected, expected_val = reference
    packing = next(k for k, v in PACKING_ARGS.items() if v == packing_args)
    out, result = two_process_runs[f"{packing}-{mode}"]
    check(result)
    checkpointing = "--activation-checkpointing" in result.args
    assert checkpointing == (packing == "pad")
    assert f"mode {mode} x2" in result.stdout
    weights = load_weights(out)
    assert max_diff(weights, expected) < (1e-6 if checkpointing else 1e-5)
    # Tied (pad runs): the embedding and lm_head stay one matrix under FSDP's sharding too.
    tied = torch.equal(weights["lm_head.weight"], weights["base_model.embed_tokens.weight"])
    assert tied == ("--tie-embeddings" in packing_args)
    assert val_loss(out) == pytest.approx(expected_val, rel=1e-5)  # each rank its share
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "tasks" in r][-1]  # the evaluation at the end
    task = result.args[result.args.index("--eval-tasks") + 1]
    assert last["step"] == 8 and last["tasks"] == task_scores(expected, out, task)
    return out


@pytest.fixture(scope="module")
def muon_reference(train_env, tmp_path_factory):
    """One process, no accumulation, no --optimizer (a new run's default is Muon at lr 4e-3):
    the weights every mode must reproduce with --optimizer muon."""
    out = tmp_path_factory.mktemp("single-muon")
    args = tiny_args(train_env, out)
    del args[args.index("--optimizer") : args.index("--optimizer") + 2]  # train.py's default
    result = check(train_here(train_env, args))
    assert "optimizer: muon, peak lr 0.004 (cosine)\n" in result.stdout
    adamw = tmp_path_factory.mktemp("single-adamw")
    check(train_here(train_env, tiny_args(train_env, adamw)))
    assert max_diff(load_weights(adamw), load_weights(out)) > 1e-3  # Muon really ran
    return load_weights(out), val_loss(out)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode",
    [["--micro-batch-size", "2"], ["--mode", "dp"], ["--mode", "ddp"], ["--mode", "fsdp"]],
    ids=str,
)
def test_muon_gives_the_same_weights_in_every_mode(
    mode, muon_reference, train_env, tmp_path, request
):
    """In fp32, Muon orthogonalizes in fp32: with accumulation, DataParallel and DDP x2 (each
    rank orthogonalizing its share) the weights are one process's to 1e-6; under FSDP2 x2 (each
    rank its share of whole matrices gathered from the shards) to 1e-5."""
    expected, expected_val = muon_reference
    out = tmp_path
    if "ddp" in mode or "fsdp" in mode:  # the runs over 2 processes: two_process_runs
        out, result = request.getfixturevalue("two_process_runs")[f"muon-{mode[1]}"]
        assert f"mode {mode[1]} x2" in check(result).stdout
        assert "optimizer: muon," in result.stdout
    else:
        check(train_here(train_env, tiny_args(train_env, tmp_path, "--optimizer", "muon", *mode)))
    assert max_diff(load_weights(out), expected) < (1e-5 if "fsdp" in mode else 1e-6)
    assert val_loss(out) == pytest.approx(expected_val, rel=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("reference", ["pack"], indirect=True)
def test_activation_checkpointing_gives_the_same_weights(reference, train_env, tmp_path):
    packing_args, expected, _ = reference
    args = tiny_args(train_env, tmp_path, *packing_args, "--activation-checkpointing")
    check(train_here(train_env, args))
    assert max_diff(load_weights(tmp_path), expected) < 1e-6


@pytest.mark.e2e
@pytest.mark.parametrize("reference", ["pack-causal"], indirect=True)
def test_ddp_without_document_mask_gives_the_same_weights(reference, two_process_runs):
    """Plain causal packing (--no-document-mask) keeps the equal-weights guarantee too, and the
    run under DDP really trained without the mask: its checkpoint says so."""
    out = two_processes_match_one("ddp", reference, two_process_runs)
    (checkpoint,) = (out / "checkpoints").iterdir()
    assert saved_setting(checkpoint, "packing") == "pack"
    assert saved_setting(checkpoint, "document_mask") is False


@pytest.mark.e2e
@pytest.mark.parametrize("reference", ["pack"], indirect=True)
def test_two_node_torchrun_gives_the_same_weights(reference, train_env, tmp_path):
    packing_args, expected, _ = reference
    args = tiny_args(train_env, tmp_path, *packing_args)
    outputs = two_nodes(args, [train_env["env"]] * 2)
    for code, out, err in outputs:
        assert code == 0, out[-2000:] + err[-3000:]
    assert "mode ddp x2" in outputs[0][1]
    assert max_diff(load_weights(tmp_path), expected) < 1e-5


@pytest.mark.e2e
def test_a_rank_whose_machine_builds_its_shards_slowly_says_so(train_env, tmp_path):
    """Two machines (two torchrun nodes here), each building its own token cache; node 1 builds
    a shard in 60 s (every shard after its first), and the collectives give up after 27 s
    (LLAMA_DDP_COLLECTIVE_TIMEOUT): its rank reports its wait, then stops with one line naming
    itself and the shard, half-way through the timeout, before its peer's collective gives up on
    it. (A 15 s timeout left 7.5 s for the two ranks' start-ups to differ: beside another test on
    2 cores, not enough.)"""
    args = tiny_args(train_env, tmp_path / "out", "--max-steps", "40", "--num-proc", "1")
    envs = []
    for rank in (0, 1):
        env = {**train_env["env"], "LLAMA_DDP_CACHE": str(tmp_path / f"cache{rank}")}
        env["LLAMA_DDP_SHARDS"] = f"first=4000,largest=4000,whole=0,delay={60 * rank},delay_from=1"
        env["LLAMA_DDP_COLLECTIVE_TIMEOUT"] = "0.45"
        envs.append(env)
    (_, _, fast_err), (slow_code, _, slow_err) = two_nodes(args, envs, forked=True)
    assert slow_code != 0
    cache = next((tmp_path / "cache1").glob("tokens-*"))
    # Shard 1 comes 60 s after shard 0: the rank's wait for it outlasts the 13.5 s however long
    # the start-ups and shard 0's steps took (up to 46 s; with 20 s, a loaded machine's rank
    # waited 10 s for shard 1, then for shard 2). Every line names the one shard waited for.
    shard = rf"train shard ([1-9]\d*) of token cache {re.escape(str(cache))}"
    # said every 27 / 8 s, stopped past 13.5 s (each at the first look after it)
    reports = re.findall(rf"rank 1: waiting (\d+) s for {shard} \(the token cache is "
                         r"still being built\)", slow_err)  # fmt: skip
    assert 1 <= len(reports) <= 4 and 3 <= int(reports[0][0]) <= 5, slow_err[-3000:]
    stop = re.search(
        rf"error: rank 1 waited (\d+) s for {shard}, which its machine is still "
        r"building, while its peers wait in a collective that gives up after 27 s \(build the "
        "whole cache first", slow_err
    )  # fmt: skip
    assert stop and 14 <= int(stop[1]) <= 16, slow_err[-3000:]
    assert {waited for _, waited in reports} == {stop[2]}, slow_err[-3000:]
    assert "Timed out" not in fast_err  # rank 0 stopped because its peer did, not on its own


@pytest.mark.e2e
def test_the_end_of_a_run_says_what_it_wrote_and_what_next(full_run):
    tail = (full_run / "stdout.txt").read_text().split("saved ", 1)[1]
    for name in ("llama_model.pth", "metrics.jsonl", "hf/", "checkpoints/step-00000012/"):
        assert str(full_run / name) in tail
    assert f"python -m llama_ddp.generate --model {full_run / 'llama_model.pth'}" in tail
    assert f"python -m llama_ddp.plot {full_run / 'metrics.jsonl'}" in tail


@pytest.mark.e2e
def test_the_last_line_and_metrics_say_where_the_time_went(full_run):
    """The run's last line: seconds and share of training steps, evaluation, checkpoints and
    waiting for data; metrics.jsonl ends with the same seconds, and each evaluation records
    the time spent before it (the training seconds to reach its loss)."""
    records = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last.keys() == {"step", "time"} and last["step"] == 12
    spent = last["time"]
    phases = ("train_s", "eval_s", "save_s", "data_s")
    # Waiting for data may round to nothing: the next batch is made while a step runs.
    assert all(spent[k] > 0 for k in phases[:3]) and spent["data_s"] >= 0
    # five values, each rounded to the millisecond: up to 2.5 ms apart
    assert spent["total_s"] == pytest.approx(sum(spent[k] for k in phases), abs=3e-3)
    line = (full_run / "stdout.txt").read_text().splitlines()[-1]
    assert line.startswith(f"where the time went ({spent['total_s']:.1f} s): ")
    assert f"training steps {spent['train_s']:.1f} s" in line
    for words in ("evaluation", "checkpoints", "waiting for data"):
        assert words in line
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]
    before = evals[0]["time"]  # before any step: only the wait for the held-out data
    assert before["train_s"] == before["eval_s"] == before["save_s"] == 0 <= before["data_s"]
    assert 0 < evals[1]["time"]["train_s"] < evals[2]["time"]["train_s"] <= spent["train_s"]
    assert evals[2]["time"]["eval_s"] < spent["eval_s"]  # the last evaluation's own time after it


@pytest.mark.e2e
def test_every_file_of_a_run_has_the_usual_mode(full_run):
    umask = os.umask(0)
    os.umask(umask)
    written = [p for p in full_run.rglob("*") if p.is_file() and p.name != "stdout.txt"]
    modes = {str(p.relative_to(full_run)): oct(p.stat().st_mode & 0o777) for p in written}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


@pytest.mark.e2e
def test_run_writes_the_design_files(full_run):
    names = {p.name for p in full_run.iterdir()} - {"stdout.txt"}
    assert {
        MODEL_FILE,
        CONFIG_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "metrics.jsonl",
        "checkpoints",
        "hf",
    } <= names
    assert [p.name for p in (full_run / "checkpoints").iterdir()] == ["step-00000012"]


@pytest.mark.e2e
def test_llama_model_pth_loads_strictly_into_a_fresh_model(full_run):
    state = torch.load(full_run / MODEL_FILE, weights_only=True)
    assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
    model = LlamaForPretraining(LlamaConfig.load(full_run / CONFIG_FILE))
    model.load_state_dict(state, strict=True)


@pytest.mark.e2e
def test_hf_export_loads_in_transformers_with_the_same_logits(full_run):
    transformers = pytest.importorskip("transformers")
    model = LlamaForPretraining(LlamaConfig.load(full_run / CONFIG_FILE)).eval()
    model.load_state_dict(torch.load(full_run / MODEL_FILE, weights_only=True))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(full_run / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(full_run / "hf")
    ids = torch.tensor([tok.encode("the cat runs over the red house")])
    with torch.no_grad():
        assert (model(ids) - theirs(ids).logits).abs().max().item() < 1e-5


def real_targets_per_step(train_env: dict, args: list[str], steps: int) -> list[int]:
    """The real target tokens of each optimizer step of the run ``args`` describe."""
    from llama_ddp.distributed import runtime as D
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import run_data

    cfg = parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")])
    batches = run_data(cfg, D.setup("single", "cpu")).batches(0)
    return [sum(b.targets for b in next(batches)) for _ in range(steps)]


@pytest.mark.e2e
def test_metrics_follow_the_schedule_and_loss_falls(full_run, train_env):
    records = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert [r["step"] for r in evals] == [0, 6, 12]
    warmup = TrainConfig().schedule.warmup(12)
    # tokens counts real targets: in pack mode with document masking, every position but those
    # whose target begins another document.
    tokens = itertools.accumulate(
        real_targets_per_step(train_env, full_run_args(train_env, full_run), 12)
    )
    for r, expected_tokens in zip(train, tokens, strict=True):
        expected = lr_at(r["step"] - 1, lr=1e-3, min_lr=1e-4, warmup_steps=warmup, total_steps=12)
        assert r["lr"] == pytest.approx(expected, rel=1e-12)
        assert {"epoch", "grad_norm", "tokens", "tokens_per_s", "mfu"} <= r.keys()
        assert r["tokens"] == expected_tokens < r["step"] * 8 * 48
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert evals[2]["val_perplexity"] == pytest.approx(2.718281828 ** evals[2]["val_loss"])
    assert evals[2]["val_loss"] < evals[0]["val_loss"] - 0.5


@pytest.mark.e2e
def test_bf16_on_a_native_cpu_tracks_fp32_and_a_resume_keeps_it(
    train_env, tmp_path, monkeypatch, capsys
):
    """--dtype auto on a CPU that multiplies bf16 natively (torch's probe answering yes) trains
    under bf16 autocast, and says so and why; resumed on a CPU without (the probe answering no),
    auto keeps the checkpoint's bf16 and warns that it is emulated. Its losses track an fp32
    run's within 2e-3: bf16 rounds the matmul inputs to 8 bits of mantissa (relative error
    2^-9), the cross-entropy is in fp32 and averages ~380 tokens, so a step's loss moves by
    about 1e-4 (measured: 1e-4 at most over these 8 steps, on AVX2, emulated bf16)."""

    def native(answer: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: answer)

    check(train_here(train_env, tiny_args(train_env, tmp_path / "fp32", "--dtype", "fp32")))
    out = tmp_path / "auto"
    args = tiny_args(train_env, out, "--save-every", "4", "--dtype", "auto")

    def stop_after_step_4(point: str, step: int) -> None:
        if point == "after-save" and step == 4:
            raise InterruptedError  # a machine lost after the checkpoint of step 4

    native(True)
    with pytest.raises(InterruptedError):
        run(
            parse_train_args([*args, "--cache-dir", str(train_env["root"] / "cache")]),
            fault=stop_after_step_4,
        )
    first = capsys.readouterr().out
    assert "precision: bf16 (auto: the CPU multiplies bf16 natively (AMX))" in first
    # --compile auto on the CPU: 8 tiny steps repay no compile, and the banner says its estimate
    assert "compile: off (auto: off for the CPU: a cold compile of 2 layers ~" in first
    assert "warning" not in first
    native(False)
    resumed = check(train_here(train_env, args))
    kept = "auto: the checkpoint's dtype, kept on resume (--dtype changes it)"
    assert f"precision: bf16 ({kept})" in resumed.stdout
    assert "warning: bf16 on a CPU without native bf16" in resumed.stdout
    records = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        for name in ("fp32", "auto")
    }
    dtypes = [(r["step"], r["dtype"], r["dtype_reason"]) for r in records["auto"] if "dtype" in r]
    assert dtypes == [
        (0, "bf16", "auto: the CPU multiplies bf16 natively (AMX)"),
        (4, "bf16", kept),
    ]
    losses = {k: [r.get("loss", r.get("val_loss")) for r in v if "loss" in r or "val_loss" in r]
              for k, v in records.items()}  # fmt: skip
    assert len(losses["auto"]) == len(losses["fp32"]) == 9  # 8 steps and the evaluation
    assert losses["auto"] == pytest.approx(losses["fp32"], abs=2e-3)
    assert losses["auto"] != losses["fp32"]  # computed in bf16, not fp32


def test_pad_mode_computes_only_real_positions_with_the_same_result(train_env, tmp_path):
    """Pad-mode batches are cut after their longest document and every per-token layer runs on
    the real positions only; the optimizer step must equal the full padded computation's."""
    from llama_ddp.data.pipeline import Batch
    from llama_ddp.distributed import runtime as D
    from llama_ddp.model.loss import IGNORE_INDEX
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    args = tiny_args(train_env, tmp_path, "--packing", "pad", "--micro-batch-size", "2")
    args += ["--seq-length", "256", "--cache-dir", str(train_env["root"] / "cache")]
    cfg = parse_train_args(args)
    results = []
    for padded in (True, False):
        trainer = build_trainer(cfg, D.setup("single", "cpu"))
        batches = next(trainer.data.batches(0))
        if padded:
            assert any(b.x.shape[1] < cfg.data.seq_length for b in batches)  # trimmed
            assert any((b.y == IGNORE_INDEX).any() for b in batches)  # unpadding has work
        else:  # the full layout: every row back to seq_length, padding included, plain causal
            width = cfg.data.seq_length
            pad = torch.nn.functional.pad
            batches = [
                Batch.of(
                    pad(b.x, (0, width - b.x.shape[1]), value=0),
                    pad(b.y, (0, width - b.y.shape[1]), value=IGNORE_INDEX),
                    padded=False,
                )
                for b in batches
            ]
        result = trainer.step(batches)
        stats, state = result.stats(), trainer.model.state_dict()
        results.append((result.loss_sum.item() / stats.targets, stats.grad_norm, state))
    (loss_a, norm_a, weights_a), (loss_b, norm_b, weights_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert norm_a == pytest.approx(norm_b, rel=1e-5)
    assert max_diff(weights_a, weights_b) < 1e-6


def test_pack_with_document_mask_trains_each_document_as_pad_mode_does(train_env, tmp_path):
    """The same documents, two to a window in pack mode with document masking or one per row in
    pad mode, give the same summed loss over the same targets, the same gradient and the same
    step. Arranged so: the training documents alternate two token lengths a and b, and the
    windows are a + b tokens (seq_length a + b - 1), so every window holds exactly two whole
    documents; pad mode's rows hold the same documents unclipped; one global batch covers the
    whole split in both modes (4 windows, 8 rows). In a window, the first document's [EOT] is
    followed by the second's [BOT], a target that document masking ignores; the second's [EOT]
    is the window's last target, as in its pad row."""
    from tokenizers import Tokenizer

    from llama_ddp.distributed import runtime as D
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    encoder = Tokenizer.from_file(str(train_env["tokenizer"]))
    rng, by_length = random.Random(13), {}
    while sum(len(d) >= 4 for d in by_length.values()) < 2:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        n = len(encoder.encode(text, add_special_tokens=False).ids) + 2  # with [BOT], [EOT]
        by_length.setdefault(n, []).append(text)
    a, b = [n for n, docs in by_length.items() if len(docs) >= 4][:2]
    docs = [d for pair in zip(by_length[a][:4], by_length[b][:4]) for d in pair]
    folder = tmp_path / "data"
    folder.mkdir()
    for name, texts in (("train", docs), ("validation", docs[:2])):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in texts)
        )
    results = []
    for packing, batch in (("pack", 4), ("pad", 8)):
        args = tiny_args(
            train_env, tmp_path / packing, "--packing", packing, "--dataset", str(folder)
        )
        args += [
            "--seq-length",
            str(a + b - 1),
            "--batch-size",
            str(batch),
        ]
        args += ["--cache-dir", str(tmp_path / "cache")]
        trainer = build_trainer(parse_train_args(args), D.setup("single", "cpu"))
        batches = next(trainer.data.batches(0))
        if packing == "pack":  # the arrangement holds: two whole documents per window
            assert len(trainer.data.train.sources[0]) == 4 and len(batches) == 1
            assert batches[0].document_ids.tolist() == [[0] * a + [1] * (b - 1)] * 4
        result = trainer.step(batches)
        stats = result.stats()
        results.append((result.loss_sum.item(), stats.targets, stats.grad_norm))
        results[-1] += (trainer.model.state_dict(),)
    (loss_a, tokens_a, norm_a, weights_a), (loss_b, tokens_b, norm_b, weights_b) = results
    assert tokens_a == tokens_b == 4 * (a - 1 + b - 1)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert norm_a == pytest.approx(norm_b, rel=1e-5)
    # AdamW's first step moves a weight by lr x g / (|g| + eps): an element whose gradient is
    # near eps (1e-8) moves by lr times its gradient's relative rounding error, up to ~1e-6 here
    # (the chunked loss rounds its gradient in another order than torch's cross_entropy).
    assert max_diff(weights_a, weights_b) < 2e-6


@pytest.mark.e2e
def test_a_mixture_run_logs_each_sources_tokens_and_validation_loss(train_env, tmp_path):
    """Two sources from a TOML file's [[sources]] tables: every step line counts each source's
    target tokens (summing to the run's), every evaluation line each source's validation loss
    (the run's val_loss is their mean by weight), and the plot draws a line per source."""
    lines = train_env["corpus"].read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:250]))
    (tmp_path / "b.jsonl").write_text("".join(lines[250:]))
    (tmp_path / "mix.toml").write_text(
        f'[[sources]]\ndataset = "{tmp_path / "a.jsonl"}"\nname = "code"\nweight = 3\n'
        f'[[sources]]\ndataset = "{tmp_path / "b.jsonl"}"\nname = "prose"\nweight = 1\n'
    )
    args = tiny_args(train_env, tmp_path / "out", "--eval-every", "4")
    i = args.index("--dataset")  # the tables are the sources
    args = [
        *args[:i],
        *args[i + 2 :],
        "--config",
        str(tmp_path / "mix.toml"),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    result = check(train_here(train_env, args))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9)) and len(evals) == 3
    for r in steps:
        assert r["source_tokens"].keys() == {"code", "prose"}
        assert sum(r["source_tokens"].values()) == r["tokens"]
    last = steps[-1]["source_tokens"]
    assert last["code"] / steps[-1]["tokens"] == pytest.approx(0.75, abs=0.02)  # the weights
    for r in evals:
        losses = r["val_loss_by_source"]
        assert losses.keys() == {"code", "prose"} and losses["code"] != losses["prose"]
        assert r["val_loss"] == pytest.approx(0.75 * losses["code"] + 0.25 * losses["prose"])
    assert f"code {evals[-1]['val_loss_by_source']['code']:.4f}" in result.stdout
    assert "from code 75%, prose 25%" in result.stdout
    from llama_ddp.plot import loss_curves
    from llama_ddp.train.metrics import read_metrics

    curves = loss_curves(*read_metrics(tmp_path / "out" / "metrics.jsonl"))
    assert list(curves) == [
        "train loss", "validation loss", "validation loss: code", "validation loss: prose"
    ]  # fmt: skip
    assert curves["validation loss: prose"] == (
        [0, 4, 8],
        [r["val_loss_by_source"]["prose"] for r in evals],
    )
