"""generation/generate.py: cached and uncached decoding agree, sampling (seed, top-k, top-p),
prompts. The command: tests/test_generate.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from llama_ddp.generation.generate import generate, generate_text, sample_next
from llama_ddp.interop.hf import export_hf
from llama_ddp.model.llama import LlamaForPretraining
from tests.helpers.runs import tiny
from tests.helpers.ties import assert_greedy_agrees

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PROMPT = "def f12(x):"
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


def prompt_ids(tok, ids, text=PROMPT):
    return [ids.bot, *tok.encode(text).ids]


# --- generation ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", PROMPT, "return x * 3 + 1  # héllo"])
def test_cached_greedy_equals_uncached(tok, ids, text):
    model = tiny(tok.get_vocab_size())
    prompt = prompt_ids(tok, ids, text)
    cached = list(generate(model, prompt, max_new_tokens=40))
    uncached = list(generate(model, prompt, max_new_tokens=40, use_cache=False))
    assert len(cached) == 40
    # products of other shapes (one new row against the whole sequence): a near tie may flip
    assert_greedy_agrees(model, prompt, cached, uncached)


def test_generate_accepts_a_tensor_and_leaves_autograd_alone(tok, ids):
    model = tiny(tok.get_vocab_size())
    prompt = prompt_ids(tok, ids)
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=3)
    next(tokens)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert [*tokens] == list(generate(model, prompt, max_new_tokens=3))[1:]


def test_a_seed_makes_sampling_reproducible(tok, ids):
    model = tiny(tok.get_vocab_size())
    prompt = prompt_ids(tok, ids)

    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return list(generate(model, prompt, max_new_tokens=30, temperature=1.0, generator=g))

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    text = generate_text(model, tok, PROMPT, max_new_tokens=20, seed=3, temperature=1.0)
    assert text == generate_text(model, tok, PROMPT, max_new_tokens=20, seed=3, temperature=1.0)


# --- sampling filters --------------------------------------------------------------------------

V = 40


def draws(logits, n=4000, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return set(sample_next(logits.expand(n, V), generator=g, **kw).tolist())


@pytest.fixture()
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5


def ranked(logits, temperature, keep=None):
    """(token, probability) best first, in float64, over the ``keep`` tokens (default: all)."""
    x = logits.double() / temperature
    keep = range(V) if keep is None else keep
    z = sum(math.exp(x[i]) for i in keep)
    return sorted(((i, math.exp(x[i]) / z) for i in keep), key=lambda t: -t[1])


def nucleus(pairs, p):
    """The smallest best-first prefix whose probability reaches p."""
    kept, mass = set(), 0.0
    for token, prob in pairs:
        kept.add(token)
        mass += prob
        if mass >= p:
            assert mass - p > 1e-3, "too close to the border for float32"
            return kept
    return kept


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_samples_only_the_k_most_likely(logits, k):
    allowed = {t for t, _ in ranked(logits, 1.0)[:k]}
    assert not draws(logits, temperature=1.0) <= allowed  # unfiltered sampling leaves the set
    got = draws(logits, temperature=1.0, top_k=k)
    assert got == allowed  # inside the set, and every member drawn: it really samples


@pytest.mark.parametrize(("p", "temperature"), [(0.5, 1.0), (0.9, 1.0), (0.8, 0.7)])
def test_top_p_samples_only_the_nucleus(logits, p, temperature):
    allowed = nucleus(ranked(logits, temperature), p)
    assert 1 < len(allowed) < V
    assert not draws(logits, temperature=temperature) <= allowed
    assert draws(logits, temperature=temperature, top_p=p) == allowed


def test_top_k_then_top_p(logits):
    top8 = [t for t, _ in ranked(logits, 1.0)[:8]]
    allowed = nucleus(ranked(logits, 1.0, keep=top8), 0.6)
    assert allowed != nucleus(ranked(logits, 1.0), 0.6)  # top-k renormalizes before top-p
    assert draws(logits, temperature=1.0, top_k=8, top_p=0.6) == allowed


def test_temperature_zero_is_argmax(logits):
    batch = torch.stack([logits, -logits])
    assert sample_next(batch, 0.0, top_k=5, top_p=0.1).tolist() == [
        logits.argmax().item(),
        logits.argmin().item(),
    ]


# --- stopping ----------------------------------------------------------------------------------


class PrefersEotFrom(LlamaForPretraining):
    """Random weights, but [EOT] wins from position ``self.at`` on."""

    eot, at = 1, 0

    def forward(self, input_ids, cache=None, *, last_only=False):
        start = cache.position if cache is not None else 0
        logits = super().forward(input_ids, cache, last_only=last_only)
        positions = torch.arange(start, start + input_ids.shape[1])[-logits.shape[1] :]
        return logits + 1e4 * F.one_hot(torch.tensor(self.eot), logits.shape[-1]) * (
            positions >= self.at
        ).view(1, -1, 1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_at_eot(tok, ids, use_cache):
    model = tiny(tok.get_vocab_size(), cls=PrefersEotFrom)
    prompt = prompt_ids(tok, ids)
    model.eot, model.at = ids.eot, len(prompt) - 1 + 3  # the 4th new token
    got = list(generate(model, prompt, max_new_tokens=50, eot_id=ids.eot, use_cache=use_cache))
    assert len(got) == 4 and got[-1] == ids.eot and ids.eot not in got[:3]
    sampled = generate(model, prompt, max_new_tokens=50, temperature=1.0, eot_id=ids.eot)
    assert len(list(sampled)) == 4
    cached = list(generate(model, prompt, max_new_tokens=50, eot_id=ids.eot))
    assert cached[-1] == ids.eot
    # generate_text decodes the cached run (the same kernels: exact); the uncached run is
    # another implementation, equal up to a near tie of the two best logits
    assert generate_text(model, tok, PROMPT, max_new_tokens=50) == PROMPT + tok.decode(cached[:-1])
    assert_greedy_agrees(model, prompt, cached, got)
    assert "[EOT]" not in tok.decode(got)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_at_the_context_limit(tok, use_cache):
    model = tiny(tok.get_vocab_size(), max_position_embeddings=32)
    kw = dict(max_new_tokens=10, use_cache=use_cache)
    assert len(list(generate(model, list(range(3, 33)), **kw))) == 3  # 30 + 3 = 32 + 1
    assert len(list(generate(model, list(range(3, 35)), **kw))) == 1  # a full context: 1 more
    with pytest.raises(ValueError, match="exceeds the context of 32"):
        generate(model, list(range(3, 36)), **kw)


# --- Hugging Face parity -----------------------------------------------------------------------


@pytest.mark.parametrize("eot_at", [None, 6])
def test_greedy_equals_transformers_generate(tok, ids, out, tmp_path, eot_at):
    transformers = pytest.importorskip("transformers")
    model = tiny(tok.get_vocab_size())
    prompt = prompt_ids(tok, ids)
    n = 20
    if eot_at is not None:
        # Swap the lm_head rows of [EOT] and of the token greedy picks at step eot_at: [EOT] is
        # then picked there, the steps before it are unchanged.
        plain = list(generate(model, prompt, max_new_tokens=n))
        target = plain[eot_at]
        assert target not in plain[:eot_at] and ids.eot not in plain
        with torch.no_grad():
            w = model.lm_head.weight
            w[[target, ids.eot]] = w[[ids.eot, target]]
    hf_dir = export_hf(model, tmp_path / "hf", out / "tokenizer.json")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.tensor([prompt])
    ref = theirs.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=ids.eot,
        pad_token_id=ids.pad,
    )[0, len(prompt) :].tolist()
    ours = list(generate(model, prompt, max_new_tokens=n, eot_id=ids.eot))
    assert_greedy_agrees(model, prompt, ours, ref)  # two implementations: a near tie may flip
    assert len(ours) == (n if eot_at is None else eot_at + 1)


def test_special_tokens_typed_in_a_prompt_are_parsed_as_the_tokenizer_does(tok, ids):
    """A prompt is the user's (unlike a training document, whose "[EOT]" stays text): the
    special tokens typed in it are those tokens, as the tokenizer's own encoding gives them."""
    from llama_ddp.generation import generate as G

    text = "x = 1[EOT][BOT]y"
    encoded = G.prompt_ids(tok, ids, text)
    assert encoded == [ids.bot, *tok.encode(text, add_special_tokens=False).ids]
    assert encoded[-3:-1] == [ids.eot, ids.bot]
