"""Chat templates: rendered as transformers renders them; generate --chat and --chat-template."""

import io

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.generate import main
from llama_ddp.generation import chat

transformers = pytest.importorskip("transformers")

# A template using what templates use: the special tokens, raise_exception, loop controls, tojson.
STRICT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}{{ raise_exception('user first') }}"
    "{% endif %}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": 'runs "fast"'},
    {"role": "user", "content": "é"},
]


@pytest.mark.parametrize("template", ["source", STRICT])
@pytest.mark.parametrize("prompt", [True, False])
def test_render_is_apply_chat_template(chat_model, template, prompt):
    tok = transformers.AutoTokenizer.from_pretrained(chat_model["source"])
    config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": "<unk>"}
    text = tok.chat_template if template == "source" else template
    theirs = tok.apply_chat_template(
        MESSAGES, chat_template=text, tokenize=False, add_generation_prompt=prompt
    )
    assert chat.render(text, MESSAGES, config, prompt) == theirs
    with pytest.raises(UserError, match="the chat template fails: user first"):
        chat.render(STRICT, MESSAGES[1:], config)


def expected_answers(path, turns, n=6):
    """transformers' greedy answers to ``turns``, each after the conversation so far, stopping
    at <|im_end|> (the template's end of turn) or <|endoftext|>."""
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
                ids, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=stop[1]
            )
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


@pytest.mark.parametrize("which", ["source", "gguf"])
def test_chat_template_answers_a_prompt_as_transformers_does(chat_model, which, capsys):
    path = chat_model[which]
    args = ["--model", str(path), "--chat-template", "--prompt", "the cat", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected_answers(path, ["the cat"])[0] + "\n"


def test_chat_is_a_conversation_from_stdin(chat_model, capsys, monkeypatch):
    path = chat_model["source"]
    monkeypatch.setattr("sys.stdin", io.StringIO("a big dog\nthen\n"))
    args = ["--model", str(path), "--chat", "--prompt", "the cat", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    answers = expected_answers(path, ["the cat", "a big dog", "then"])
    assert capsys.readouterr().out == "".join(a + "\n" for a in answers)


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
