"""chat.py: chat templates rendered as transformers renders them. `generate --chat` and
`--chat-template`: tests/test_generate.py."""

import pytest

from llama_ddp.errors import UserError
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
