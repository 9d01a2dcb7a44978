"""BPETokenizer.token_bytes(): each id's bytes as they appear in decoded text (what grammar libraries match
against), on a tiny byte-level vocabulary; and llguidance's view of it built by service/engine/structured.py."""

from __future__ import annotations

import pytest
from engine_util import BPE_SPECIALS, tiny_bpe
from tokenizers import pre_tokenizers

from model.bpe_tokenizer import BPETokenizer
from service.engine.structured import Grammars

TEXTS = ["hello world", "  two  spaces", "你好 😀 café", "<|im_start|>user\nhi<|im_end|>", "{\"a\": [1, 2]}"]


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return tiny_bpe()


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_of_the_ids_spell_the_text(tok, text):
    table = tok.token_bytes()
    assert b"".join(table[i] for i in tok.encode(text)) == text.encode("utf-8")


def test_every_byte_once_merges_and_specials(tok):
    table = tok.token_bytes()
    assert len(table) == tok.vocab_size
    assert table[:3] == [s.encode() for s in BPE_SPECIALS] and tok.special_ids == {0, 1, 2}
    assert sorted(table[3:259]) == [bytes([b]) for b in range(256)]
    assert table[259:] == [b"he", b"ll", b"hell", b" w", b" wo", "你".encode()[:2]]  # a partial character too


def test_a_grammar_over_it_spells_json_and_never_a_special_token(tok):
    g = Grammars(tok, tok.vocab_size, tok.stop_ids())
    m = g.compile({"type": "object", "properties": {"hello": {"const": "wo"}}, "required": ["hello"]})
    ids = tok.encode('{"hello":"wo"}')
    assert m.consume_tokens(ids) and m.is_accepting()
    m = g.compile({"type": "string"})
    assert m.consume_tokens(tok.encode('"'))
    word = g.fill([m])[0]
    allowed = {i for i in range(tok.vocab_size) if (int(word[i // 32]) >> (i % 32)) & 1}
    table = tok.token_bytes()
    assert {table.index(b"hell"), table.index(b" wo"), table.index(b'"')} <= allowed
    assert not allowed & {0, 1, 2}  # inside a string: no special token, no end of sequence


def test_a_grammar_over_a_tokenizer_that_adds_bos_never_asks_for_it():
    """Llama-style tokenizers add BOS to a prompt (add_bos_token). llguidance tokenizes the text it forces
    with our tokenizer: given a BOS first, a schema whose output is fixed allowed only BOS as the first token,
    so the reply could never spell the JSON."""
    tok = tiny_bpe()
    tok.config.update(add_bos_token=True, bos_token="<|im_start|>")
    assert tok.encode("wo")[0] == tok.bos_id
    g = Grammars(tok, tok.vocab_size, tok.stop_ids())
    m = g.compile({"type": "object", "properties": {"hello": {"const": "wo"}}, "required": ["hello"]})
    word = g.fill([m])[0]
    allowed = {i for i in range(tok.vocab_size) if (int(word[i // 32]) >> (i % 32)) & 1}
    assert tok.bos_id not in allowed and tok.token_bytes().index(b"{") in allowed
    assert m.consume_tokens(tok.encode_rendered('{"hello":"wo"}')) and m.is_accepting()


def test_a_control_token_spelled_outside_the_byte_alphabet_stays_one_special_token():
    """DeepSeek-style GGUFs name control tokens in characters GPT-2's byte alphabet lacks
    ("<｜begin▁of▁sentence｜>"): matched whole as special tokens, found as bos, decoded as written."""
    bos = "<｜begin▁of▁sentence｜>"
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [bos, "<|im_end|>", *chars]
    tok = BPETokenizer.from_gguf_metadata({"model": "gpt2", "tokens": tokens, "token_type": [3, 3] + [1] * len(chars),
                                           "merges": [], "bos_token_id": 0, "eos_token_id": 1})
    assert tok.vocab_size == len(tokens) and tok.bos_id == 0 and tok.eos_id == 1
    ids = tok.encode(f"{bos}hi<|im_end|>")
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) == 4
    assert tok.decode(ids) == f"{bos}hi<|im_end|>" and tok.token_bytes()[0] == bos.encode()
    assert tok.special_ids == {0, 1}


def test_a_chat_template_that_writes_no_bos_gets_none_as_in_hf(tmp_path):
    """add_bos_token set, a template without {{ bos_token }}: HF's apply_chat_template and vLLM's chat routes
    tokenize the rendered text with no BOS added; a plain prompt still gets its BOS."""
    from transformers import AutoTokenizer

    from service.frontend.generator import GeneratorFrontend

    tok = tiny_bpe()
    template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    tok.config.update(add_bos_token=True, bos_token="<|im_start|>", chat_template=template)
    tok.save(tmp_path)
    conv = [{"role": "user", "content": "hello"}]
    ref = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(conv, tokenize=True)
    ids = GeneratorFrontend(engine=None, tokenizer=tok, chat_template=template).encode_chat(conv)
    assert ids == (ref if isinstance(ref, list) else ref["input_ids"]) and tok.bos_id not in ids
    assert tok.encode("hello")[0] == tok.bos_id


def test_add_bos_token_gives_one_bos_when_the_chat_template_writes_it_too():
    """Llama/Mistral tokenizers set add_bos_token and their chat templates begin with {{ bos_token }}: the
    prompt holds one BOS, as HF's apply_chat_template gives it; a plain prompt gets its BOS."""
    from service.frontend.generator import GeneratorFrontend

    tok = tiny_bpe()
    tok.config.update(add_bos_token=True, bos_token="<|im_start|>")
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    ids = GeneratorFrontend(engine=None, tokenizer=tok, chat_template=template).encode_chat(
        [{"role": "user", "content": "hello"}])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.encode("hello")[0] == tok.bos_id
