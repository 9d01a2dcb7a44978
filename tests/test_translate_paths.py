"""One translation path: `attnserve translate` and `POST /v1/translate` give identical outputs for identical
input (the shipped translator, the served settings), multi-sentence texts included; and the decoding
option against loops (`no_repeat_ngram`) holds in the engine exactly as offline."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace

import httpx
import pytest
import torch
from engine_util import CharTokenizer, tiny_seq2seq

from model.decoding import NEG_INF, BeamState, advance_all, banned_tokens, beam_candidates, min_len_for, row_topk
from model.generate import beam_search
from model.translation import encode_source
from service import cli, local
from service.api.app import create_app
from service.engine.config import EngineConfig
from service.engine.translation import TranslationEngine
from service.engine.types import TranslateRequest
from service.frontend.translator import TranslationFrontend
from service.models import load_backends

TEXTS = [
    "本基金亦可投资于货币市场工具和持有现金。",
    "The Fund may also invest in money market instruments. It may also hold cash for liquidity.",
    "今天天气很好。我们去公园散步吧！",
    "The Securities and Futures Commission may, by notice in writing, require the licensed person to "
    "provide the information. Failure to comply is an offence.",
    "\nGood morning.\n",  # blank lines around a text are kept, here as over HTTP
]


def _http_translations(texts: list[str], **body) -> list[str]:
    """POST /v1/translate to the translator a replica builds from the Serve config (compiled where it is)."""
    cfg = local.serve_config()
    cfg = replace(cfg, generator=replace(cfg.generator, enabled=False))
    backends = load_backends(cfg, log=lambda *_: None)
    assert backends.translator is not None

    async def main():
        app = create_app(backends, static_dir=None)
        await backends.start()
        assert backends.translator.engine.compiled is not None  # served compiled: so is the CLI
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/translate", json={"text": texts, **body})
                assert r.status_code == 200, r.text
                return r.json()["translations"]
        finally:
            await backends.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("beam", [1, 4])
def test_cli_and_http_translate_identically(beam, capsys):
    assert local.translator_spec() == local.serve_config().translator  # compiled, dtype... as served
    assert cli.main(["translate", "--beam", str(beam), *TEXTS]) == 0
    cli_out = capsys.readouterr().out
    http_out = _http_translations(TEXTS, beam_size=beam)  # all texts in one request, batched together
    assert cli_out == "".join(f"{t}\n" for t in http_out)
    assert all(t.strip() for t in http_out) and http_out[-1].startswith("\n") and http_out[-1].endswith("\n")


def test_cli_reports_a_missing_checkpoint_without_a_traceback(capsys):
    assert cli.main(["translate", "--model", "/nonexistent/checkpoint", "x"]) == 2
    assert "no translator checkpoint" in capsys.readouterr().err


def test_banned_tokens():
    assert banned_tokens([5, 6, 7, 5, 6], 3) == [7]  # "5 6 7" exists: after "5 6", 7 is banned
    assert banned_tokens([5, 6, 5], 2) == [6]  # after "5", 6 would repeat "5 6"
    assert banned_tokens([1, 2, 3], 4) == []
    assert sorted(banned_tokens([1, 2, 1], 1)) == [1, 2]
    assert banned_tokens([1, 2, 3], 0) == []


def _repeats(seq: list[int], n: int) -> bool:
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("beam", [1, 3])
def test_no_repeat_ngram_in_the_engine_equals_offline_and_never_repeats(beam):
    """A tiny random model loops readily; with no_repeat_ngram 2 no output holds a bigram twice, and the
    engine (continuous batch) chooses exactly the offline tokens."""
    torch.manual_seed(0)
    model, tok = tiny_seq2seq(), CharTokenizer()
    texts = ["hello there", "abcabcabc", "the cat sat on the mat", "xyz"]
    translator = TranslationFrontend(TranslationEngine(model, EngineConfig(max_slots=16, max_seq_len=64)), tok)
    got = local.translate(translator, texts, target_lang="zh", beam_size=beam, no_repeat_ngram=2, max_length=20)
    srcs = [encode_source(tok, t, "zh") for t in texts]
    off = beam_search(model, srcs, beam_size=beam, no_repeat_ngram=2, max_len_a=0, max_len_b=20)
    assert got.translations == [tok.decode(h[0].tokens) for h in off]
    assert not any(_repeats(h[0].tokens, 2) for h in off)
    plain = beam_search(model, srcs, beam_size=beam, no_repeat_ngram=0, max_len_a=0, max_len_b=20)
    assert any(_repeats(h[0].tokens, 2) for h in plain), "the case lost its loops: the test would prove nothing"


def test_request_defaults_come_from_one_place():
    from model import translation
    from service.api.schemas import TranslateBody

    body = TranslateBody(text="x")
    req = TranslateRequest(texts=["x"])
    assert (body.beam_size, body.length_penalty, body.no_repeat_ngram, body.min_length_ratio) == (
        req.beam_size, req.length_penalty, req.no_repeat_ngram, req.min_length_ratio) == (
        translation.DEFAULT_BEAM_SIZE, translation.DEFAULT_LENGTH_PENALTY, translation.DEFAULT_NO_REPEAT_NGRAM,
        translation.DEFAULT_MIN_LENGTH_RATIO)


@pytest.mark.parametrize("k", [1, 4])
def test_no_end_before_the_minimum_length(k):
    """EOS, the best token at every step, is banned until min_len tokens stand; then it ends the output.
    min_len_for counts the source's pieces without its tag and end token and stays within the limit."""
    assert (min_len_for(12, 0.5, 30), min_len_for(12, 0.0, 30), min_len_for(100, 1.0, 30)) == (5, 0, 30)
    v, eos = 20, 2
    for min_len in (0, 6):
        st = BeamState([3, 4, 5], k, limit=30, bos_id=1, eos_id=eos, pad_id=0, min_len=min_len)
        while not st.done:
            logits = torch.arange(v, dtype=torch.float32).repeat(k, 1) / 10  # (k, V): high ids first
            logits[:, eos] = 10.0
            advance_all([st], logits, [list(range(k))])
        assert len(st.best()) == min_len and eos not in st.best()


def test_a_step_of_many_beams_equals_each_beam_stepped_alone():
    """advance_all batches the log-softmax and top-k of every state: each state must choose as if alone,
    whatever its beam size, position in the batch and banned n-grams."""
    torch.manual_seed(0)
    v = 50
    states = [BeamState([3], k, limit=30, bos_id=1, eos_id=2, pad_id=0, no_repeat_ngram=n)
              for k, n in ((4, 2), (1, 0), (2, 3), (4, 0), (1, 2), (3, 2))]
    alone = copy.deepcopy(states)
    for _ in range(12):
        live = [i for i, st in enumerate(states) if not st.done]
        if not live:
            break
        rows, r = [], 0
        for i in live:
            rows.append(list(range(r, r + states[i].k))[::-1])  # rows need not be in order
            r += states[i].k
        logits = torch.randn(r, v) * 3
        batched = advance_all([states[i] for i in live], logits, rows)
        for i, got, own in zip(live, batched, rows, strict=True):
            assert advance_all([alone[i]], logits, [own]) == [got]
            assert alone[i].seqs == states[i].seqs and alone[i].scores == states[i].scores
    assert any(st.k > 1 and st.step > 3 for st in states)


@pytest.mark.parametrize("v", [1024, 8000, 50])
def test_row_topk_equals_topk(v):
    """The chunk-maxima top-k: the same values as topk, indices that hold them, -inf (banned) entries and
    rows whose best cluster in one chunk included; a vocabulary that chunks do not divide falls back."""
    g = torch.Generator().manual_seed(v)
    x = torch.randn(12, v, generator=g) * 4
    x[0, :200] += 40  # the best all in few chunks
    x[1, ::3] = NEG_INF
    x[2, 5:] = NEG_INF  # fewer finite entries than asked
    for n in (2, 8, 16):
        vals, idx = row_topk(x, n)
        ref = x.topk(n, -1)
        assert torch.equal(vals, ref.values) and torch.equal(x.gather(1, idx), vals)
        assert all(len(set(r)) == n for r in idx.tolist())


def test_beam_candidates_equal_a_topk_over_each_sources_scores():
    """The two-stage choice (per row, then per source) gives what one topk over a source's k x V does."""
    g = torch.Generator().manual_seed(1)
    v, k = 1024, 4
    states = [BeamState([3], k, limit=30, bos_id=1, eos_id=2, pad_id=0, no_repeat_ngram=2) for _ in range(3)]
    states[0].scores = [-1.5, -2.0, NEG_INF, -3.25]  # a dead beam
    states[1].scores = [-0.5, -0.75, -4.0, -6.0]
    states[1].seqs = [[7, 8, 7], [9], [9, 9], [5]]  # bans: 8 after ...7
    logits = torch.randn(3 * k, v, generator=g) * 3
    rows = [[0, 1, 2, 3], [7, 6, 5, 4], [8, 9, 10, 11]]
    got = beam_candidates(states, logits, rows)
    for st, r, (s_, i_) in zip(states, rows, got, strict=True):
        logp = torch.log_softmax(logits[r].float(), -1)
        for j, seq in enumerate(st.seqs):
            logp[j, banned_tokens(seq, 2)] = NEG_INF
        ref = (torch.tensor(st.scores)[:, None] + logp).view(-1).topk(2 * k)
        assert s_ == ref.values.tolist() and i_ == ref.indices.tolist()
