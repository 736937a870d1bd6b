"""Runs of train.py for the tests (in a subprocess, under torchrun, or in this process), and the
files and tiny models they are made from."""

import atexit
import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.train.cli import main as train_main
from tests.helpers.leftovers import stat_fields

os.environ["HF_HUB_OFFLINE"] = "1"


os.environ["HF_DATASETS_OFFLINE"] = "1"


ROOT = Path(__file__).resolve().parents[2]


TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 🦙",
    "for i in range(10):\n\tprint(i)  # count\n",
] * 8


WORDS = (
    "the a cat dog runs jumps over under big small red blue house tree river stone and then "
    "because while if else return def class import from print value"
).split()


def tiny_args(train_env: dict, out_dir: Path, *extra: str) -> list[str]:
    """train.py's flags for a tiny run, in fp32 (tests that compare modes prove equality to the
    reduction order, which only fp32 can: ``--dtype auto`` is bf16 on a CPU with AVX512-BF16 or
    AMX) with AdamW (the article's optimizer; a later ``--dtype`` or ``--optimizer`` in
    ``extra`` wins); a ``--dataset`` in ``extra`` replaces the corpus (a repeated --dataset
    would mix the two)."""
    dataset = [] if "--dataset" in extra else ["--dataset", str(train_env["corpus"])]
    return [
        "--preset", "tiny", *dataset,
        "--tokenizer", str(train_env["tokenizer"]), "--seq-length", "48",
        "--batch-size", "8", "--max-steps", "8", "--log-every", "1",
        "--out-dir", str(out_dir), "--no-export-hf", "--dtype", "fp32", "--optimizer", "adamw",
        *extra,
    ]  # fmt: skip


def train_command(args: list[str], torchrun: list[str] | None = None) -> list[str]:
    """train.py's command line with ``args``, under torchrun when given its flags."""
    if torchrun is None:
        return [sys.executable, str(ROOT / "train.py"), *args]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, str(ROOT / "train.py"), *args]


def run_train(train_env: dict, args: list[str], torchrun: list[str] | None = None, **kw):
    """Run train.py in a subprocess (under torchrun when given its flags: `run_torchrun`)."""
    if torchrun is not None:
        return run_torchrun(train_env, torchrun, [str(ROOT / "train.py"), *args])
    return subprocess.run(
        train_command(args),
        env=train_env["env"],
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def wait_for_steps(metrics: Path, proc: subprocess.Popen, count: int = 3) -> None:
    """Return once ``metrics`` (a run's metrics.jsonl, --log-every 1) holds ``count`` step lines
    (not any line: evaluations log too); an AssertionError if ``proc`` ends or 120 s pass first."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"loss"') >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the run logged no steps in time")


def signal_after_steps(
    command: list[str],
    env: dict,
    metrics: Path,
    count: int,
    *,
    pause: float = 0.0,
    group: bool = False,
    forked: bool = False,
) -> tuple[subprocess.Popen, str, str]:
    """Start ``command``, SIGTERM it once ``metrics`` holds ``count`` step lines (and ``pause``
    seconds more): the process (``group``: its process group, in a session of its own, as torchrun
    and its workers are under a scheduler), then wait for it; stopped by its PID (or group) with
    SIGKILL if it is still running after. The process (its returncode set), stdout and stderr.
    ``forked``: ``command`` is train.py's args, run as a `Forked` process (no interpreter's
    start: for a run whose subject is not the process's start or end)."""
    pipe = subprocess.PIPE
    if forked:
        proc = Forked(train_main, command, env)
    else:
        proc = subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True,
                                start_new_session=group)  # fmt: skip
    try:
        wait_for_steps(metrics, proc, count)
        time.sleep(pause)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.communicate()
    return proc, out, err


def runs_in_one_torchrun(
    train_env: dict, folder: Path, runs: dict[str, list[str]], nproc: int = 2
) -> dict[str, subprocess.CompletedProcess]:
    """train.py's runs (name -> args) one after the other in one torchrun launch of ``nproc``
    processes (tests/helpers/torchrun_runs.py, by `run_torchrun`), as `run_train` would run each
    under torchrun: what its ranks printed and its exit code (-1: never run, an earlier run
    failed). torchrun's start is paid once for all of them."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "runs.json"
    spec.write_text(json.dumps({"folder": str(folder), "runs": runs}))
    script = str(ROOT / "tests" / "helpers" / "torchrun_runs.py")
    flags = ["--standalone", f"--nproc_per_node={nproc}"]
    launch = run_torchrun(train_env, flags, [script, str(spec)], timeout=600)
    results = {}
    for name, args in runs.items():
        files = [{k: folder / f"{name}.rank{r}.{k}" for k in ("stdout", "stderr", "code")}
                 for r in range(nproc)]  # fmt: skip
        codes = [int(f["code"].read_text()) for f in files if f["code"].exists()]
        code = next((c for c in codes if c != 0), 0) if len(codes) == nproc else -1
        out, err = (
            "".join(f[k].read_text() for f in files if f[k].exists()) for k in ("stdout", "stderr")
        )
        if code != 0:
            err += f"\n[the launch: exit code {launch.returncode}]\n{launch.stderr[-3000:]}"
        results[name] = subprocess.CompletedProcess(args, code, out, err)
    return results


# What every rank process of `start_ranks` imports, imported once by the server they fork from
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", __name__]


def start_ranks(fn, args: tuple, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` new processes (torch.multiprocessing), each forked from
    multiprocessing's fork server, which imported `FORKSERVER_PRELOAD` once for the session
    (conftest): a process starts in ~0.3 s of CPU, against ~4.8 s for a spawned one's imports
    of torch, its compiler front end (an optimizer step's) and ours. The server forks before any
    thread or OpenMP pool exists, and each process sets its own environment (ranks, ports)."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _in_this_process(
    main, args: list[str], env: dict, cwd: str, out: str, err: str, file_size: int | None
) -> NoReturn:
    """`run_forked`'s process: a command's environment, folder, output and exit (``main(args)``,
    its exit code, as an interpreter gives ``sys.exit``'s), its files capped at ``file_size``
    bytes where given (a full disk: the write fails with EFBIG). It leads a process group of its
    own, which the processes it starts join (torchrun's forked workers, the token cache's
    builder): `Forked` waits for them all and stops them all."""
    os.setpgrp()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read from the environment again ($TMPDIR), as a new process would
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if file_size is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's exit 2, or sys.exit in main
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("..."): the interpreter prints it and exits 1
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter's exit would (the token cache's builder)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Forked:
    """``main(args)`` started in a process forked from the fork server (`_in_this_process`), as
    a subprocess of its own would run, with Popen's handle (``pid``, `poll`, `send_signal`,
    `kill`, `communicate`; ``returncode``: its exit code, or minus the signal that ended it).
    As ``subprocess.run`` waits for every process that holds its pipes, `communicate` waits
    for every process of its group (a worker or builder left running fails it as a hang would);
    `kill` stops them all."""

    def __init__(self, main, args: list[str], env: dict, file_size: int | None = None) -> None:
        self.args, self._folder = list(args), tempfile.mkdtemp(prefix="forked-")
        self._out, self._err = Path(self._folder, "stdout"), Path(self._folder, "stderr")
        child = (main, self.args, env, os.getcwd(), str(self._out), str(self._err), file_size)
        self._proc = multiprocessing.get_context("forkserver").Process(
            target=_in_this_process, args=child
        )
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, signum: int) -> None:
        """``signum`` to the process, unless it has ended (as Popen's: its PID may be reused)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the process and every process of its group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def _group_left(self) -> bool:
        """Whether a live process (not a zombie) of its group is still running."""
        for proc in Path("/proc").glob("[0-9]*"):
            fields = stat_fields(proc.name)
            if fields is not None and fields[0] != "Z" and int(fields[2]) == self.pid:
                return True
        return False

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the process and its group, then what it printed; a TimeoutExpired after
        ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        while self._group_left():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        out, err = self._out.read_text(), self._err.read_text()
        shutil.rmtree(self._folder, ignore_errors=True)
        return out, err


def _forked(main, args: list[str], env: dict, file_size: int | None = None, timeout: int = 300):
    """`Forked`'s run to its end: its exit code (or minus the signal that ended it) and what it
    printed; a TimeoutExpired after ``timeout`` s, as `run_train`'s subprocess.run raises."""
    proc = Forked(main, args, env, file_size)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:  # killed here, it would read as the fault's SIGKILL
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_forked(
    train_env: dict, args: list[str], file_size: int | None = None
) -> subprocess.CompletedProcess:
    """train.py's command line in a process of its own, as `run_train` runs it (its environment,
    exit code or the signal that ended it, what it printed), forked from the fork server
    (`start_ranks`) without a new interpreter's ~5 s of imports: for runs that must end as a
    process does (LLAMA_DDP_FAULT's SIGKILL), whose subject is not the interpreter's start."""
    return _forked(train_main, args, train_env["env"], file_size)


FORKED_WORKER = ROOT / "tests" / "helpers" / "forked_worker.py"


def torchrun_main(argv: list[str]) -> int:
    """torchrun's command line (``python -m torch.distributed.run``) in this process."""
    import warnings

    from torch.distributed.run import main

    # Python 3.12 and later warn at each fork of the agent, whose rendezvous runs threads
    warnings.filterwarnings("ignore", r".*use of fork\(\) may lead", DeprecationWarning)
    main(argv)
    return 0


def run_torchrun(
    train_env: dict, torchrun: list[str], command: list[str], timeout: int = 300
) -> subprocess.CompletedProcess:
    """``torchrun <torchrun flags> <script> <args>`` (``command``: the script's absolute path and
    its args), as the torchrun command runs it (its agent's rendezvous, restarts, exit code and
    what its ranks printed), but with each worker forked from the agent (torchrun's own
    ``--run-path --start-method fork``; tests/helpers/forked_worker.py runs the script), and
    the agent forked from the fork server: no process imports torch again (~5 s of CPU a
    worker, ~2.5 s an agent). The torchrun command itself, each worker a new interpreter, is
    run by the tests of signals and of a worker's start (test_resume) and of two nodes giving
    one process's weights (test_train)."""
    return _forked(
        torchrun_main, torchrun_argv(torchrun, command), train_env["env"], timeout=timeout
    )


def torchrun_argv(torchrun: list[str], command: list[str]) -> list[str]:
    """`run_torchrun`'s command line for torchrun's ``main`` (``Forked(torchrun_main, argv, env)``
    starts one launch without waiting for it: one node of several)."""
    return [*torchrun, "--run-path", "--start-method", "fork", str(FORKED_WORKER), *command]


def train_here(train_env: dict, args: list[str]) -> subprocess.CompletedProcess:
    """train.py's command line run in this process, as `run_train` runs it in a subprocess (its
    environment, one thread, the exit code and what it printed), without a new interpreter's
    start-up: for single-process runs whose subject is the run, not the process."""
    saved = {k: os.environ.get(k) for k in ("LLAMA_DDP_CACHE", "LLAMA_DDP_FAULT")}
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    os.environ["LLAMA_DDP_CACHE"] = train_env["env"]["LLAMA_DDP_CACHE"]
    os.environ.pop("LLAMA_DDP_FAULT", None)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in train_env
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train_main(list(args))
    finally:
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def load_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(out_dir) / "llama_model.pth", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def chat_source(folder: Path, texts: list[str]) -> Path:
    """What a small instruct model's folder holds, made with transformers: a tied Llama (GQA,
    random norms, rope_theta 5e5) and a byte-level BPE with an unk token, a chat template, BOS
    <|im_start|>, EOS <|im_end|>, pad <|endoftext|> and a generation config."""
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=CHAT_SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=5e5, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_gguf(source: Path, path: Path) -> Path:
    """``source`` (a `chat_source` folder) as llama.cpp's converter writes it, with the `gguf`
    package: llama.cpp's tensor names, q/k rows permuted for its RoPE, matrices quantized to
    Q8_0, norms F32, the embedding stored once (tied), and the tokenizer (tokens, types, merges,
    its special token ids, add_bos_token, the chat template) in the metadata."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(source)
    c = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny chat")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(5e5)
    w.add_vocab_size(c.vocab_size)
    data = json.loads((source / "tokenizer.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in CHAT_SPECIALS else 1 for t in tokens])  # 3: control
    w.add_token_merges([" ".join(m) for m in data["model"]["merges"]])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def permute(a, heads):  # llama.cpp's RoPE pairs (i, i + 1), Hugging Face's (i, i + D/2)
        return a.reshape(heads, 2, a.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(a.shape)

    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute(a, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = permute(a, c.num_key_value_heads)
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            key = f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        if a.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            a = gguf.quants.quantize(np.ascontiguousarray(a), q8)
            w.add_tensor(key, a, raw_shape=a.shape, raw_dtype=q8)
        else:
            w.add_tensor(key, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def full_run_args(train_env: dict, out) -> list[str]:
    args = tiny_args(train_env, out, "--max-steps", "12", "--eval-every", "6")
    return [a for a in args if a != "--no-export-hf"]


def write_task(path: Path, count: int = 12) -> Path:
    rng = random.Random(1)
    lines = []
    for _ in range(count):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in "abc"]
        lines.append({"context": context, "choices": choices, "label": rng.randrange(3)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def fake_hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """A Hugging Face hub cache holding ``repo`` (revision main) with ``folder``'s files, laid
    out as huggingface_hub writes it: what a machine that downloaded it once has."""
    storage = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    shutil.copytree(folder, storage / "snapshots" / commit)
    return root


def rewrite_manifest(checkpoint: Path, drop: tuple[str, ...] = ()) -> None:
    """Make a checkpoint's manifest match the files in it (minus ``drop``), as someone crafting
    a checkpoint would: every checksum then agrees."""
    manifest_path = Path(checkpoint) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(Path(checkpoint).iterdir())
        if p.name != "manifest.json" and p.name not in drop
    }
    manifest_path.write_text(json.dumps(manifest))


def tiny(vocab_size: int, seed: int = 0, cls=LlamaForPretraining, **overrides):
    torch.manual_seed(seed)
    return cls(preset("tiny", vocab_size=vocab_size, **overrides)).eval()
