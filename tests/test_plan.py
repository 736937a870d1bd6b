"""plan.py: ``python -m llama_ddp.plan``, what --model-size auto would choose without training:
for a stated GPU node (its choice rule.py's `choose` at the same step times, 10-40 tokens a
parameter for 8 hours of 8 H100s), on this machine's measured step times end to end, its
--json, and every mistake one line and exit 2."""

import json
import math
import re
import subprocess
import sys

import pytest

from llama_ddp.plan import main
from llama_ddp.train.budget.budget import TIMED_STEPS
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.sizing.rule import MEASURE_SHARE, Size, choose
from tests.helpers.runs import ROOT

H100_NODE = ["--peak-tflops", "989", "--mfu", "0.4", "--devices", "8", "--seq-length", "2048",
             "--batch-size", "256", "--vocab-size", "32768"]  # fmt: skip


def plan(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(list(flags))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_gpu_node_for_8_hours_trains_10_to_40_tokens_a_parameter(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, err = plan(capsys, *H100_NODE, "--time-budget", "8h", "--json", str(out_file))
    assert code == 0 and err == "", err
    written = json.loads(out_file.read_text())
    choice = written["choice"]
    assert 10 <= choice["tokens_per_parameter"] <= 40 and choice["depth"] >= 20
    assert {"depth", "parameters", "tokens", "tokens_per_parameter", "predicted_bpb",
            "source"} <= choice.keys()  # fmt: skip
    assert choice["predicted_bpb"] is None and choice["source"] == "law"  # far beyond the runs
    size = Size.of(choice["depth"], 32768, 2048)
    assert choice["parameters"] == size.parameters  # all of them, as the banner counts
    assert choice["tokens_per_parameter"] == pytest.approx(choice["tokens"] / size.parameters)
    depths = [c["depth"] for c in written["candidates"]]
    assert choice["depth"] in depths and depths == sorted(depths)
    table = out.splitlines()
    assert table[0] == "candidates (step times stated: 8 x 989 TFLOPS at 40% MFU):"
    assert table[1].split() == ["depth", "parameters", "tokens", "tokens/param", "predicted",
                                "bpb", "epochs", "step", "s", "source"]  # fmt: skip
    chosen = [line for line in table if line.startswith("*")]
    assert len(chosen) == 1 and chosen[0].split()[1] == str(choice["depth"])
    assert f"model size: auto chose depth {choice['depth']} (" in out
    assert f"wrote {out_file}" in out


def test_a_stated_device_chooses_what_choose_does_at_its_step_times(capsys, tmp_path):
    """rule.py's `choose` fed the node's step times (FLOPs x tokens / (peak x MFU x devices))
    and the budget's own `fit`, its clock moved by the timing: the same depth and tokens."""
    out_file = tmp_path / "plan.json"
    code, out = plan(capsys, *H100_NODE, "--time-budget", "1h", "--json", str(out_file))[:2]
    assert code == 0 and "timed" not in out.replace("nothing timed", "")  # stated, not measured
    assert "from its FLOPs on the stated device (d1 " in out
    planned = json.loads(out_file.read_text())["choice"]
    cfg = parse_train_args(["--model-size", "auto", "--time-budget", "1h", "--seq-length", "2048",
                            "--batch-size", "256"])  # fmt: skip
    step_tokens, now = 256 * 2048, [0.0]
    sizes = [Size.of(d, 32768, 2048) for d in range(1, 65)]

    def measure(size):
        step_s = size.flops * step_tokens / (989e12 * 0.4 * 8)
        now[0] += (1 + TIMED_STEPS) * step_s
        return step_s

    def fit(size, step_s):
        budget = cfg.time_budget(size.parameters, 0.0)
        budget.clock, budget.origin = (lambda: now[0]), 0.0
        return budget.fit(step_s)

    ours = choose(sizes, measure, fit, step_tokens, MEASURE_SHARE * 3600, lambda: now[0])
    assert (ours.best.depth, ours.best.tokens) == (planned["depth"], planned["tokens"])


def test_a_tied_run_counts_its_embedding_once(capsys, tmp_path):
    files = {tied: tmp_path / f"{tied}.json" for tied in (False, True)}
    for tied, path in files.items():
        flags = [*H100_NODE, "--time-budget", "10m", "--json", str(path)]
        assert plan(capsys, *flags, *(["--tie-embeddings"] if tied else []))[0] == 0
    untied, tied = (json.loads(files[t].read_text())["candidates"][0] for t in (False, True))
    assert untied["depth"] == tied["depth"] == 1
    assert untied["parameters"] - tied["parameters"] == 32768 * 64  # one embedding fewer


@pytest.mark.e2e
def test_on_this_machine_it_times_the_candidates_as_auto_does(train_env, tmp_path):
    """End to end, the command as users type it: the tiny corpus timed here, its size known
    (the repetition said), the table and the JSON agreeing with the banner's choice."""
    out_file = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "llama_ddp.plan", "--time-budget", "90s", "--seq-length", "48",
           "--batch-size", "8", "--dataset", str(train_env["corpus"]), "--tokenizer",
           str(train_env["tokenizer"]), "--json", str(out_file)]  # fmt: skip
    env = {**train_env["env"], "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "candidates (step times measured on this machine (cpu)):" in out
    written = json.loads(out_file.read_text())
    choice = written["choice"]
    assert f"model size: auto chose depth {choice['depth']} (" in out
    assert choice["source"] == "runs" and choice["predicted_bpb"] > 0
    assert choice["epochs"] > 1 and "note: the corpus holds 0.0" in out  # 25k tokens a pass
    assert all(c["step_s"] > 0 and c["steps"] > 0 for c in written["candidates"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--peak-tflops", "-1"], r"--peak-tflops -1 must be a number above 0"),
        (["--peak-tflops", "nan"], r"--peak-tflops nan must be a number above 0"),
        (["--peak-tflops", "fast"], r"argument --peak-tflops: invalid float value: 'fast'"),
        (["--peak-tflops", "989", "--mfu", "0"], r"--mfu 0 must be a number from above 0 to 1"),
        (["--peak-tflops", "989", "--mfu", "1.5"], r"--mfu 1\.5 must be a number from above 0"),
        (["--peak-tflops", "989", "--devices", "0"], r"--devices 0 must be a number above 0"),
        (["--peak-tflops", "989", "--devices", "2.5"], r"argument --devices: invalid int"),
        (["--mfu", "0.5"], r"--mfu describes a stated device \(add --peak-tflops"),
        (["--peak-tflops", "989", "--seq-length", "0"], r"--seq-length 0 must be a number above"),
        (["--peak-tflops", "989", "--batch-size", "-4"], r"--batch-size -4 must be a number"),
        (["--peak-tflops", "989", "--time-budget", "soon"], r"--time-budget must be a duration"),
        (["--peak-tflops", "989", "--time-budget", "1s"], r"--time-budget 1s holds no step: the "
         r"end alone keeps \d+\.\d s and a step of depth 1 takes .* \(give a longer"),
        (["--peak-tflops", "989", "--tokenizer", "/no/such/tokenizer.json"],
         r"/no/such/tokenizer\.json"),
    ],
)  # fmt: skip
def test_a_mistake_is_one_line_and_exit_2(capsys, flags, message):
    budget = [] if "--time-budget" in flags else ["--time-budget", "1h"]
    code, out, err = plan(capsys, *budget, *flags)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(message, err), err


def test_an_existing_json_is_kept_without_force(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    out_file.write_text("{}")
    code, out, err = plan(capsys, *H100_NODE, "--time-budget", "1h", "--json", str(out_file))
    assert code == 2 and out == "" and err.startswith("error: ") and "--force" in err
    assert out_file.read_text() == "{}"
    assert (
        plan(capsys, *H100_NODE, "--time-budget", "1h", "--json", str(out_file), "--force")[0] == 0
    )
    assert math.isfinite(json.loads(out_file.read_text())["choice"]["tokens_per_parameter"])


def test_the_command_line_is_one_line_and_exit_2_as_a_process():
    cmd = [sys.executable, "-m", "llama_ddp.plan", "--peak-tflops", "989"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: the following arguments are required: --time-budget (see python -m "
        "llama_ddp.plan --help)"
    ]


def test_a_slurm_budget_for_a_stated_device_is_the_jobs_time_left(capsys, monkeypatch, tmp_path):
    """--time-budget slurm is a deadline on the real clock: the stated device's simulated clock
    counts from 0 to the job's time left (it counted the machine's uptime as budget too: a job
    with an hour left planned 6,768 steps of 1.37 s, 2.6 hours)."""
    import time

    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 3780))  # 3600 s after its margin
    slurm, hour = tmp_path / "slurm.json", tmp_path / "hour.json"
    assert plan(capsys, *H100_NODE, "--time-budget", "slurm", "--json", str(slurm))[0] == 0
    assert plan(capsys, *H100_NODE, "--time-budget", "1h", "--json", str(hour))[0] == 0
    a, b = (json.loads(f.read_text())["choice"] for f in (slurm, hour))
    assert a["depth"] == b["depth"] and a["tokens"] == pytest.approx(b["tokens"], rel=0.01)
