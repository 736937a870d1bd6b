"""generate.py: ``python -m llama_ddp.generate``: the text it prints (streamed, held back at a
split character), its notes, its one-line refusals and exit codes, a chat through the model's
template (``--chat``, ``--chat-template``), and ``--perplexity``."""

import io
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from llama_ddp.data.tokenizer_files import save_tokenizer, special_ids
from llama_ddp.eval.perplexity import perplexity
from llama_ddp.generate import _Stream, main
from llama_ddp.generation.generate import generate_text
from llama_ddp.interop.native import save_model
from tests.helpers.runs import ROOT, tiny
from tests.helpers.ties import TIE

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PROMPT = "def f12(x):"
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# --- streaming ---------------------------------------------------------------------------------


def test_stream_holds_back_split_characters(tok):
    euro = tok.encode("€").ids  # unseen in training: three byte tokens
    assert len(euro) == 3
    stream = _Stream(tok)
    assert [stream.push(t) for t in euro] == ["", "", "€"]
    ids = tok.encode("x = '€10' # wörld").ids + euro[:1]
    stream = _Stream(tok)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


# --- CLI ---------------------------------------------------------------------------------------


def run_cli(*args, **kw):
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llama_ddp.generate", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, **kw)


def expected_text(out, tok, prompt=PROMPT, n=5):
    model = tiny(tok.get_vocab_size())  # the weights saved in `out`
    return generate_text(model, tok, prompt, max_new_tokens=n) + "\n"


def test_cli_generates_greedy_text(out, tok):
    args = ["--model", out / "llama_model.pth", "--prompt", PROMPT, "--temperature", "0"]
    r = run_cli(*args, "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected_text(out, tok)
    assert r.stderr == ""


def test_cli_missing_model_is_one_error_line(tmp_path):
    r = run_cli("--model", tmp_path / "nothing.pth", "--prompt", "x")
    assert r.returncode == 2
    assert r.stderr.startswith("error: model ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


def test_cli_damaged_model_files_are_one_error_line(out, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(out / "hf", hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short
    assert main(["--model", str(hf), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a readable safetensors file" in err
    folder = tmp_path / "pth"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("hf"))
    (folder / "llama_model.json").write_text('{"hidden_size": ')
    assert main(["--model", str(folder), "--prompt", "x"]) == 2
    assert "is not readable JSON" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["hf", "folder", "no-stream"])
def test_cli_same_text_from_hf_folder_or_folder(out, tok, capsys, where):
    model = {"hf": out / "hf", "folder": out, "no-stream": out / "llama_model.pth"}[where]
    args = ["--model", str(model), "--prompt", PROMPT, "--temperature", "0"]
    args += ["--max-new-tokens", "5"] + (["--no-stream"] if where == "no-stream" else [])
    assert main(args) == 0
    assert capsys.readouterr().out == expected_text(out, tok)


def test_cli_reads_the_prompt_from_stdin(out, tok, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))
    assert main(["--model", str(out), "--temperature", "0", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == expected_text(out, tok)


def test_cli_sampling_with_a_seed_repeats(out, capsys):
    args = ["--model", str(out), "--prompt", PROMPT, "--seed", "5", "--top-k", "20"]
    args += ["--top-p", "0.9", "--max-new-tokens", "15"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_cli_says_when_the_context_is_full(tok, tmp_path, capsys):
    model = tiny(tok.get_vocab_size(), max_position_embeddings=16)
    tok_path = tmp_path / "tokenizer.json"
    save_tokenizer(tok, tok_path)
    save_model(model, model.config, tmp_path / "short", tok_path)
    args = ["--model", str(tmp_path / "short"), "--temperature", "0", "--max-new-tokens", "50"]
    assert main([*args, "--prompt", PROMPT]) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("note: stopped at the model's context limit of 16 tokens")
    assert cap.err.count("\n") == 1
    assert main([*args, "--prompt", PROMPT * 5]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt is ") and "context of 16" in err and err.count("\n") == 1


def mismatched_config(tmp_path, tok):
    other = tiny(tok.get_vocab_size(), hidden_size=32)
    other.config.save(tmp_path / "other.json")
    return tmp_path / "other.json"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokenizer", "missing.json"], "error: tokenizer file missing.json not found"),
        (["--config", "CONFIG"], "does not match its config"),
        (["--temperature", "-1"], "error: temperature -1.0 must be >= 0"),
        (["--top-p", "0"], "error: top-p 0.0 must be in (0, 1]"),
        (["--bogus"], "error: unrecognized arguments: --bogus"),
        (["--perplexity", "missing.txt"], "error: perplexity file missing.txt not found"),
    ],
)
def test_cli_user_errors_are_one_line(out, tok, tmp_path, capsys, extra, message):
    extra = [str(mismatched_config(tmp_path, tok)) if e == "CONFIG" else e for e in extra]
    assert main(["--model", str(out / "llama_model.pth"), "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_cuda_without_gpu_is_a_user_error(out, capsys):
    assert main(["--model", str(out), "--prompt", "x", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: --device cuda but no CUDA GPU")


def test_cli_debug_shows_the_traceback(tmp_path):
    from llama_ddp.errors import UserError

    with pytest.raises(UserError):
        main(["--model", str(tmp_path / "nothing"), "--prompt", "x", "--debug"])


def test_cli_closed_pipe_ends_quietly(out):
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llama_ddp.generate", "--model", str(out), "--prompt", PROMPT]
    cmd += ["--max-new-tokens", "50", "--seed", "0"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # the reader is gone before the first word is printed (`| head -0`)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert stderr == ""


def test_cli_perplexity_of_a_file(out, tok, tmp_path, capsys):
    text = "def f3(x):\n    return x * 3 + 3\n" * 20
    (tmp_path / "doc.py").write_text(text)
    assert (
        main(["--model", str(out), "--perplexity", str(tmp_path / "doc.py"), "--seq-length", "64"])
        == 0
    )
    ids = special_ids(tok)
    stream = [ids.bot, *tok.encode(text).ids, ids.eot]
    expected = perplexity(tiny(tok.get_vocab_size()), stream, 64)
    # bits per byte: the summed loss in bits over the file's 640 bytes (ASCII: one per character)
    bpb = math.log(expected) * (len(stream) - 1) / math.log(2) / 640
    assert len(text) == 640
    assert capsys.readouterr().out == (
        f"perplexity: {expected:.4f} ({len(stream) - 1} tokens, 640 bytes), "
        f"bits per byte {bpb:.4f}\n"
    )


def test_cli_perplexity_of_an_empty_file_is_one_line_before_the_model_loads(
    out, tmp_path, capsys, monkeypatch
):
    """An empty file has nothing to score ("perplexity: 380.7246 (1 tokens, 0 bytes)" before:
    the [EOT] after [BOT]); it is refused before the model is read."""
    import llama_ddp.generate

    (tmp_path / "empty.txt").write_text("")

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llama_ddp.generate, "open_model", never)
    assert main(["--model", str(out), "--perplexity", str(tmp_path / "empty.txt")]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: perplexity file {tmp_path / 'empty.txt'} is empty: there is nothing to score "
        "(give a file with text)\n",
    )


def test_cli_perplexity_of_the_validation_split(out, tok, tmp_path, capsys, monkeypatch):
    import llama_ddp.data.corpus

    docs = ["def a():\n    pass\n", "x = 1\n"]
    splits = {"sample": SimpleNamespace(validation=iter(docs))}
    monkeypatch.setattr(llama_ddp.data.corpus, "load_splits", splits.__getitem__)
    monkeypatch.chdir(tmp_path)  # no file named "validation" here
    assert main(["--model", str(out), "--perplexity", "validation"]) == 0
    ids = special_ids(tok)
    model = tiny(tok.get_vocab_size())
    streams = [[ids.bot, *tok.encode(d).ids, ids.eot] for d in docs]  # each document alone
    total = sum(math.log(perplexity(model, s)) * (len(s) - 1) for s in streams)
    count = sum(len(s) - 1 for s in streams)
    expected, bpb = math.exp(total / count), total / math.log(2) / 24  # 18 + 6 bytes
    assert capsys.readouterr().out == (
        f"perplexity: {expected:.4f} ({count} tokens, 24 bytes), bits per byte {bpb:.4f}\n"
    )


# --- chat ----------------------------------------------------------------------------------------


def expected_answers(path, turns, n=6):
    """transformers' greedy answers to ``turns``, each after the conversation so far, stopping
    at <|im_end|> (the template's end of turn) or <|endoftext|>; each with its tokens' texts
    (prefixes of the answer, one a token) and the gap of its two best logits at each token."""
    transformers = pytest.importorskip("transformers")
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if kw else path
    tok = transformers.AutoTokenizer.from_pretrained(folder, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    stop = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    messages, answers = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.eval().generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[1],
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, ids.shape[1] :]
        top2 = [s[0].topk(2).values for s in out.scores]
        answer = tok.decode(new, skip_special_tokens=True)
        prefixes = [tok.decode(new[: i + 1], skip_special_tokens=True) for i in range(len(new))]
        answers.append((answer, prefixes, [(a - b).item() for a, b in top2]))
        messages.append({"role": "assistant", "content": answer})
    return answers


def assert_answers_agree(printed, expected):
    """The answers ``printed`` (one a line) are transformers' ``expected`` ones, or equal up to
    a token where its two best logits tie within TIE (two fp32 implementations, each choosing
    kernels by ISA, may then pick the other; that answer and the rest of the chat are not
    compared). transformers' logits stand in for ours: they differ by under 1e-5."""
    for answer, prefixes, gaps in expected:
        if printed.startswith(answer + "\n"):
            printed = printed[len(answer) + 1 :]
            continue
        i = next((i for i, p in enumerate(prefixes) if not printed.startswith(p)), len(prefixes))
        assert i < len(gaps) and gaps[i] < TIE, f"{printed!r} against {answer!r} (token {i})"
        return
    assert printed == ""


@pytest.mark.parametrize("which", ["source", "gguf"])
def test_chat_template_answers_a_prompt_as_transformers_does(chat_model, which, capsys):
    path = chat_model[which]
    args = ["--model", str(path), "--chat-template", "--prompt", "the cat", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    assert_answers_agree(capsys.readouterr().out, expected_answers(path, ["the cat"]))


def test_chat_is_a_conversation_from_stdin(chat_model, capsys, monkeypatch):
    path = chat_model["source"]
    monkeypatch.setattr("sys.stdin", io.StringIO("a big dog\nthen\n"))
    args = ["--model", str(path), "--chat", "--prompt", "the cat", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    answers = expected_answers(path, ["the cat", "a big dog", "then"])
    assert_answers_agree(capsys.readouterr().out, answers)


def test_a_chat_needs_a_template(chat_model, tmp_path, capsys):
    from llama_ddp.data.tokenizer import train_tokenizer
    from llama_ddp.data.tokenizer_files import save_tokenizer

    save_tokenizer(train_tokenizer(["the cat runs"] * 10, 280), tmp_path / "tokenizer.json")
    args = ["--model", str(chat_model["source"]), "--tokenizer", str(tmp_path), "--chat"]
    assert main([*args, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    path = tmp_path / "tokenizer.json"
    assert (
        err
        == f"error: the tokenizer {path} has no chat template (give one: --chat-template FILE)\n"
    )
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args[-1] = "--chat-template"  # FILE, for one turn
    assert main([*args, str(tmp_path / "t.jinja"), "--max-new-tokens", "2", "--prompt", "x"]) == 0
