"""Encoder-decoder: cached decoding, padding, post-LN structure, beam search."""

import dataclasses

import torch

from model.config import TINY_SEQ2SEQ
from model.generate import beam_search, greedy
from model.seq2seq import EncoderDecoder


def _model(**kw):
    return EncoderDecoder(dataclasses.replace(TINY_SEQ2SEQ, **kw)).eval()


def test_cached_decoding_equals_teacher_forcing_staggered():
    m = _model()
    V = m.cfg.vocab_size
    srcs = [torch.randint(3, V, (n,)) for n in (9, 4, 6)]
    tgts = [torch.randint(3, V, (n,)) for n in (12, 7, 10)]
    full = [m(s[None], t[None])[0] for s, t in zip(srcs, tgts)]
    cache = m.new_cache(6)
    slots, start = [5, 0, 2], [0, 3, 5]
    pos = [None] * 3
    err = 0.0
    for step in range(16):
        for r in range(3):
            if start[r] == step:  # admit: encode and store cross K/V in this row's slot
                mem = m.encode(srcs[r][None])
                m.set_cross(mem, torch.ones(1, len(srcs[r]), dtype=torch.bool), cache, [slots[r]])
                pos[r] = 0
        run = [r for r in range(3) if pos[r] is not None and pos[r] < len(tgts[r])]
        if not run:
            continue
        toks = torch.stack([tgts[r][pos[r]] for r in run])[:, None]
        out = m.decode(toks, torch.tensor([pos[r] for r in run])[:, None], cache, [slots[r] for r in run])
        for i, r in enumerate(run):
            err = max(err, (out[i, 0] - full[r][pos[r]]).abs().max().item())
            pos[r] += 1
    assert err <= 1e-5


def test_source_padding_does_not_change_outputs():
    m = _model()
    src = torch.randint(3, m.cfg.vocab_size, (1, 5))
    tgt = torch.randint(3, m.cfg.vocab_size, (1, 6))
    padded = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], 1)
    assert (m(src, tgt) - m(padded, tgt)).abs().max().item() <= 1e-5


def test_post_ln_is_the_default_and_pre_ln_differs():
    assert TINY_SEQ2SEQ.norm_first is False
    post = _model()
    assert isinstance(post.enc_norm, torch.nn.Identity)
    pre = _model(norm_first=True)
    pre.load_state_dict(post.state_dict(), strict=False)
    src = torch.randint(3, 97, (1, 5))
    tgt = torch.randint(3, 97, (1, 4))
    assert not torch.allclose(post(src, tgt), pre(src, tgt), atol=1e-3)


def test_beam_size_one_equals_greedy_and_hypotheses_sorted():
    torch.manual_seed(3)
    m = _model()
    srcs = [torch.randint(3, 97, (n,)).tolist() for n in (5, 8, 3)]
    g = greedy(m, srcs, max_len_b=12, max_len_a=0)
    b1 = beam_search(m, srcs, beam_size=1, alpha=0.0, max_len_b=12, max_len_a=0)
    assert [h[0].tokens for h in b1] == g
    for hyps in beam_search(m, srcs, beam_size=4, max_len_b=12, max_len_a=0):
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True) and len(hyps) >= 1


def test_batched_beam_search_equals_one_at_a_time():
    torch.manual_seed(4)
    m = _model()
    srcs = [torch.randint(3, 97, (n,)).tolist() for n in (5, 9, 2, 6)]
    batched = beam_search(m, srcs, beam_size=3, max_len_b=10, max_len_a=0)
    for s, hb in zip(srcs, batched, strict=True):
        alone = beam_search(m, [s], beam_size=3, max_len_b=10, max_len_a=0)[0]
        assert [h.tokens for h in hb] == [h.tokens for h in alone]
        for x, y in zip(hb, alone):
            assert abs(x.score - y.score) < 1e-4


def test_bf16_weights_with_a_float32_cache_cross_attention_included():
    m = _model()
    m16 = m.to(torch.bfloat16)
    m32 = _model()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    src, tgt = torch.randint(3, m.cfg.vocab_size, (1, 9)), torch.randint(3, m.cfg.vocab_size, (1, 12))
    full = m32(src, tgt)[0]  # (T, V)
    cache = m16.new_cache(3, dtype=torch.float32)
    m16.set_cross(m16.encode(src), torch.ones(1, 9, dtype=torch.bool), cache, [2])
    assert cache.cross_k.dtype == torch.float32
    got = torch.cat([m16.decode(tgt[:, t:t + 1], torch.tensor([[t]]), cache, [2])[0] for t in range(12)])
    assert got.dtype == torch.bfloat16
    assert (got.float() - full).abs().max().item() < 0.05 * full.abs().max().item()


def test_float32_weights_with_a_bf16_cache_cross_attention_included(monkeypatch):
    """kv_dtype bfloat16 on an fp32 host: the decode step reads the bf16 cache as it is (the prefix kernel,
    cross-attention included) instead of widening the whole source cache every step."""
    m = _model()
    src, tgt = torch.randint(3, m.cfg.vocab_size, (1, 9)), torch.randint(3, m.cfg.vocab_size, (1, 12))
    full = m(src, tgt)[0]  # (T, V)
    cache = m.new_cache(3, dtype=torch.bfloat16)
    m.set_cross(m.encode(src), torch.ones(1, 9, dtype=torch.bool), cache, [1])
    assert cache.cross_k.dtype == torch.bfloat16
    widened, cross = [], {cache.cross_k.untyped_storage().data_ptr(), cache.cross_v.untyped_storage().data_ptr()}
    to = torch.Tensor.to

    def spy(t, *a, **kw):
        out = to(t, *a, **kw)
        if out.dtype == torch.float32 and t.untyped_storage().data_ptr() in cross:
            widened.append(tuple(t.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    got = torch.cat([m.decode(tgt[:, t:t + 1], torch.tensor([[t]]), cache, [1])[0] for t in range(12)])
    assert got.dtype == torch.float32 and widened == []  # no float32 copy of the source's K/V
    assert (got - full).abs().max().item() < 0.05 * full.abs().max().item()


def test_hypotheses_cut_at_the_length_limit_end_there_once_each():
    """At the limit a hypothesis can only end (fairseq forces EOS): each was finished with the score of its
    best next token, a token it does not hold, once per such token, so the n-best held duplicates."""
    torch.manual_seed(5)
    m = _model()
    src = torch.randint(3, 97, (6,)).tolist()
    hyps = beam_search(m, [src], beam_size=4, alpha=0.0, max_len_b=3, max_len_a=0, no_repeat_ngram=0)[0]
    capped = [h for h in hyps if len(h.tokens) == 3]
    assert capped and len({tuple(h.tokens) for h in hyps}) == len(hyps)
    for h in capped:  # its log-probability, EOS at the limit included (alpha 0: no length penalty)
        tgt = torch.tensor([[m.cfg.bos_id, *h.tokens]])
        logp = torch.log_softmax(m(torch.tensor([src]), tgt)[0], -1)  # (4, V)
        want = sum(logp[t, tok].item() for t, tok in enumerate([*h.tokens, m.cfg.eos_id]))
        assert abs(h.score - want) < 1e-4
