"""OpenAI-shape logprobs over a byte-level tokenizer whose tokens split characters ("你" is two tokens):
`text_offset` is where each token starts in the returned text, chat `bytes` are the token's own bytes
(joined, they spell the text), and special tokens the engine leaves out of generated text are left out of
the text, not its token_ids."""

from __future__ import annotations

import pytest
import torch
from engine_util import run_engine, tiny_bpe, tiny_llama

from service.api.logprob_format import CompletionLogprobs, TokenTexts, chat_content
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.types import GenerateRequest, SamplingParams, TokenLogprob

TEXT = "你好 café 😀 ok"


@pytest.fixture(scope="module")
def tok():
    return tiny_bpe()


def entries(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=i, logprob=-1.0, top=[(i, -1.0)]) for i in ids]


def test_text_offsets_count_characters_not_token_pieces(tok):
    ids = tok.encode(TEXT)
    table = tok.token_bytes()
    assert any(table[i].decode("utf-8", "replace") == "\ufffd" for i in ids)  # a character split across tokens
    out = CompletionLogprobs(TokenTexts(tok.decode, lambda: table)).render([(i, None) for i in ids], [])
    offsets = out["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(TEXT)
    for i, o in enumerate(offsets):
        before = b"".join(table[j] for j in ids[:i])
        assert o == len(before.decode("utf-8", "ignore"))
        try:
            before.decode("utf-8")
        except UnicodeDecodeError:
            continue  # token i continues a character: it starts where that character does
        assert TEXT[o:] == tok.decode(ids[i:])
    assert offsets[-1] == len(TEXT) - 1  # "k", one byte, one token


def test_offsets_carry_across_streamed_chunks_and_from_the_echoed_prompt(tok):
    ids = tok.encode(TEXT)
    texts = TokenTexts(tok.decode, tok.token_bytes)
    whole = CompletionLogprobs(texts).render([(i, None) for i in ids[:3]], entries(ids[3:]))["text_offset"]
    state = CompletionLogprobs(texts)
    parts = [state.render([(i, None) for i in ids[:3]], [])]
    parts += [state.render([], entries([i])) for i in ids[3:]]  # one generated token per chunk, as streamed
    assert [o for p in parts for o in p["text_offset"]] == whole


def test_generated_special_tokens_take_no_room_in_the_text(tok):
    a, b = tok.encode("ab")
    special = tok.token_to_id("<|im_start|>")
    texts = TokenTexts(tok.decode, tok.token_bytes, hidden={special})
    out = CompletionLogprobs(texts).render([(special, None)], entries([a, special, b]))
    assert out["text_offset"] == [0, len("<|im_start|>"), len("<|im_start|>") + 1, len("<|im_start|>") + 1]
    assert out["tokens"] == ["<|im_start|>", "a", "<|im_start|>", "b"]  # named, as vLLM lists them


def test_chat_bytes_are_the_tokens_own_and_join_into_the_text(tok):
    ids = tok.encode(TEXT)
    content = chat_content(TokenTexts(tok.decode, tok.token_bytes), entries(ids))
    assert bytes(b for c in content for b in c["bytes"]).decode("utf-8") == TEXT
    assert any(c["token"] == "\ufffd" for c in content)  # a piece of a character: its text says nothing
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)


def test_without_a_byte_table_bytes_are_the_tokens_text(tok):
    texts = TokenTexts(tok.decode)
    (a,) = tok.encode("a")
    assert texts.bytes(a) == b"a" and texts.text(a) == "a"


def test_a_sampled_special_token_is_in_token_ids_not_in_the_text(tok):
    torch.manual_seed(0)
    engine = GenerationEngine(tiny_llama(vocab_size=tok.vocab_size), tok, EngineConfig(max_slots=2, max_seq_len=64),
                              eos_ids={tok.eos_id})
    special = tok.token_to_id("<|im_start|>")
    assert special != tok.eos_id and special in tok.special_ids

    async def main(e):
        req = GenerateRequest(prompt_ids=tok.encode("hello"), params=SamplingParams(
            max_new_tokens=3, temperature=0.0, logit_bias={special: 100.0}))
        return [ev async for ev in e.submit(req)]

    events = run_engine(engine, main)
    assert [t for ev in events for t in ev.token_ids] == [special] * 3
    assert "".join(ev.text for ev in events) == ""
