"""data/tokenizer_files.py: reading tokenizer files (ours, hub-style, a GGUF file's), the roles
they give, by config or by flag, and the files a run writes."""

import json
import re

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llama_ddp.data.tokenizer import text_encoder, train_tokenizer
from llama_ddp.data.tokenizer_files import (
    TOKENIZER_CONFIG,
    SpecialIds,
    SpecialTokens,
    load_tokenizer,
    read_tokenizer,
    save_tokenizer,
    special_tokens,
    tokenizer_config,
    write_tokenizer_files,
)
from llama_ddp.errors import UserError


def test_load_refuses_tokenizer_lacking_a_special_token(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[BOT]", "[EOT]"])
    tok.train_from_iterator(["some text"], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(UserError, match=r"lacks the special token \[PAD\]"):
        load_tokenizer(path)


def test_load_refuses_special_token_that_is_plain_vocabulary(tiny_tokenizer, tmp_path):
    data = json.loads(tiny_tokenizer.to_str())
    for added in data["added_tokens"]:
        if added["content"] == "[EOT]":
            added["special"] = False
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"\[EOT\]"):
        load_tokenizer(path)


def test_load_missing_and_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a readable tokenizer.json"):
        load_tokenizer(bad)


@pytest.fixture()
def hub_folder(tmp_path):
    """A byte-level BPE with <s> and </s>, no pad token, saved the way transformers saves one."""
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer(["the cat runs over the red house"] * 20, 300)  # [BOT]... at 0-2
    tok.add_special_tokens(["<s>", "</s>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(tmp_path / "hub")
    return tmp_path / "hub"


def test_a_hub_tokenizer_maps_bos_eos_and_pads_with_eos(hub_folder):
    tok, special = read_tokenizer(hub_folder)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (bos, eos) == (tok.get_vocab_size() - 2, tok.get_vocab_size() - 1)
    assert special == SpecialTokens("<s>", "</s>", "</s>", SpecialIds(bot=bos, eot=eos, pad=eos))
    assert read_tokenizer(hub_folder / "tokenizer.json")[1] == special  # the file, or its folder
    assert special.describe() == f"BOT <- <s> ({bos}), EOT <- </s> ({eos}), PAD <- </s> ({eos})"
    assert text_encoder(tok).encode("<s>hi</s>").ids[0] != special.ids.bot  # typed: text


def test_roles_may_be_added_token_objects_and_name_a_pad(hub_folder):
    config = json.loads((hub_folder / TOKENIZER_CONFIG).read_text())
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "special": True}
    config["pad_token"] = "[PAD]"
    (hub_folder / TOKENIZER_CONFIG).write_text(json.dumps(config))
    tok, special = read_tokenizer(hub_folder)
    assert special.ids == SpecialIds(tok.token_to_id("<s>"), tok.token_to_id("</s>"), pad=2)


def test_without_a_bos_its_eos_opens_each_document_too(hub_folder):
    config = json.loads((hub_folder / TOKENIZER_CONFIG).read_text())
    (hub_folder / TOKENIZER_CONFIG).write_text(json.dumps({**config, "bos_token": None}))
    tok, special = read_tokenizer(hub_folder)
    eos = tok.token_to_id("</s>")
    assert special.ids == SpecialIds(bot=eos, eot=eos, pad=eos)
    assert (special.bot, special.eot, special.pad) == ("</s>", "</s>", "</s>")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"eos_token": None}, "names no eos_token (add it, or name one with --eot-token"),
        ({"eos_token": "<|end|>"}, "its eos_token '<|end|>' is not a special token"),
        ({"pad_token": 7}, "pad_token 7 is not a token"),
    ],
)
def test_roles_that_do_not_resolve_are_refused(hub_folder, change, message):
    config = json.loads((hub_folder / TOKENIZER_CONFIG).read_text())
    (hub_folder / TOKENIZER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=re.escape(message)):
        read_tokenizer(hub_folder)


def test_a_damaged_tokenizer_config_is_one_line(hub_folder):
    (hub_folder / TOKENIZER_CONFIG).write_text('["<s>", "</s>"]')
    with pytest.raises(UserError, match="tokenizer config .* is not a JSON object"):
        read_tokenizer(hub_folder)
    (hub_folder / TOKENIZER_CONFIG).write_text('{"bos_token": ')
    with pytest.raises(UserError, match="tokenizer config .* is not readable JSON"):
        read_tokenizer(hub_folder)


def test_the_written_tokenizer_config_reads_back_as_the_same_roles(tiny_tokenizer, tmp_path):
    save_tokenizer(tiny_tokenizer, tmp_path / "tokenizer.json")
    ours = special_tokens(tiny_tokenizer)
    assert ours == SpecialTokens("[BOT]", "[EOT]", "[PAD]", SpecialIds(0, 1, 2))
    (tmp_path / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(ours)))
    assert read_tokenizer(tmp_path)[1] == ours


# --- roles by flag, the source's config kept, a GGUF file's tokenizer (issue 24) ---------------


def test_flags_name_the_roles_by_name_or_id_and_a_run_records_them(chat_model, tmp_path):
    source = chat_model["source"]
    tok, default = read_tokenizer(source)
    assert (default.bot, default.eot, default.pad) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    end = tok.token_to_id("<|endoftext|>")
    _, special = read_tokenizer(source, {"bot": "<|endoftext|>", "eot": str(end), "pad": None})
    assert special.ids == SpecialIds(end, end, end)
    for value in ("the", "9999", "<|im_end"):
        with pytest.raises(UserError, match=f"--eot-token '{re.escape(value)}' is not a special"):
            read_tokenizer(source, {"eot": value})
    # Our tokenizers need no config when the flags name every missing role.
    ours = train_tokenizer(["a b c"] * 5, 270)
    ours.add_special_tokens(["<s>"])
    save_tokenizer(ours, tmp_path / "t" / "tokenizer.json")
    roles = {"bot": "<s>", "eot": "<s>", "pad": "<s>"}
    assert read_tokenizer(tmp_path / "t", roles)[1].names() == roles
    # The run's tokenizer_config.json: the source's own, the roles recorded beside it.
    config = tokenizer_config(special, json.loads((source / TOKENIZER_CONFIG).read_text()))
    assert config["llama_ddp_roles"] == {"bot": "<|endoftext|>", "eot": "<|endoftext|>",
                                         "pad": "<|endoftext|>"}  # fmt: skip
    assert (config["bos_token"], config["unk_token"]) == ("<|im_start|>", "<unk>")
    run = tmp_path / "run"
    run.mkdir()
    write_tokenizer_files(source, special, run)
    assert sorted(p.name for p in run.iterdir()) == [
        "chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    assert read_tokenizer(run)[1] == special  # the recorded roles come first


def test_a_gguf_files_tokenizer_is_the_sources(chat_model, tmp_path):
    """--tokenizer model.gguf: transformers' reading of it, made into a folder once (cached), with
    the source's vocabulary, special tokens and chat template."""
    from llama_ddp.data.tokenizer import resolve_tokenizer

    tok, special, path = resolve_tokenizer(str(chat_model["gguf"]), None, 0, tmp_path)
    assert path.parent.name.startswith("gguf-tokenizer-") and path.parent.parent == tmp_path
    theirs, source = read_tokenizer(chat_model["source"])
    assert special == source
    text = "the cat <|im_start|>runs over 12 houses!"
    assert tok.encode(text).ids == theirs.encode(text).ids
    assert (path.parent / "chat_template.jinja").read_text() == (
        chat_model["source"] / "chat_template.jinja"
    ).read_text()
    again = resolve_tokenizer(str(chat_model["gguf"]), None, 0, tmp_path)
    assert again[2] == path and len(list(tmp_path.iterdir())) == 1
