"""Decoder-only LM: cached decoding, causality, padding, GQA, RoPE, slot reuse."""

import dataclasses

import pytest
import torch

from model.config import TINY_GPT2, TINY_LLAMA
from model.decoder import DecoderLM
from model.layers import RotaryEmbedding, apply_rope

CONFIGS = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}


@pytest.fixture(params=list(CONFIGS))
def model(request):
    return DecoderLM(CONFIGS[request.param]).eval()


def test_cached_decoding_equals_full_recompute_with_staggered_rows(model):
    """Rows with different prompt lengths, admitted at different steps, in scattered slots."""
    V = model.cfg.vocab_size
    seqs = [torch.randint(0, V, (n,)) for n in (30, 22, 26)]
    full = [model(s[None])[0] for s in seqs]  # (T, V) each, no cache
    prompt_len = [5, 9, 3]
    start_step = [0, 4, 7]  # the step at which each row is admitted
    slots = [6, 1, 3]
    cache = model.new_cache(8, 64)
    pos = [None] * 3
    err = 0.0
    for step in range(20):
        # admit rows whose time has come (prefill), then decode all running rows in ONE forward
        for r in range(3):
            if start_step[r] == step:
                p = prompt_len[r]
                out = model(seqs[r][None, :p], torch.arange(p)[None], cache, [slots[r]])
                err = max(err, (out[0] - full[r][:p]).abs().max().item())
                pos[r] = p
        running = [r for r in range(3) if pos[r] is not None and pos[r] < len(seqs[r])]
        if not running:
            continue
        toks = torch.stack([seqs[r][pos[r]] for r in running])[:, None]  # (B, 1)
        positions = torch.tensor([pos[r] for r in running])[:, None]  # (B, 1)
        out = model(toks, positions, cache, [slots[r] for r in running])  # (B, 1, V)
        for i, r in enumerate(running):
            err = max(err, (out[i, 0] - full[r][pos[r]]).abs().max().item())
            pos[r] += 1
    assert err <= 1e-5


def test_padded_prefill_batch_equals_rows_alone(model):
    V = model.cfg.vocab_size
    lens = [7, 3, 5]
    seqs = [torch.randint(0, V, (n,)) for n in lens]
    t = max(lens)
    toks = torch.zeros(3, t, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    cache = model.new_cache(3, 32)
    last = torch.tensor(lens) - 1
    batched = model(toks, torch.arange(t).expand(3, t), cache, [0, 1, 2], output_index=last)  # (B, V)
    for i, s in enumerate(seqs):
        alone = model(s[None])[0, -1]
        assert (batched[i] - alone).abs().max().item() <= 1e-5


def test_left_padded_batch_without_cache(model):
    V = model.cfg.vocab_size
    s = torch.randint(0, V, (6,))
    toks = torch.cat([torch.zeros(3, dtype=torch.long), s])[None]  # 3 pads on the left
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    valid = torch.tensor([[False] * 3 + [True] * 6])
    padded = model(toks, positions, key_valid=valid)[0, 3:]
    alone = model(s[None])[0]
    assert (padded - alone).abs().max().item() <= 1e-5


def test_causality(model):
    V = model.cfg.vocab_size
    a = torch.randint(0, V, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % V
    la, lb = model(a), model(b)
    assert torch.allclose(la[0, :8], lb[0, :8], atol=1e-6)
    assert not torch.allclose(la[0, 8:], lb[0, 8:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = DecoderLM(TINY_LLAMA).eval()
    mha_cfg = dataclasses.replace(TINY_LLAMA, n_kv_heads=TINY_LLAMA.n_heads)
    mha = DecoderLM(mha_cfg).eval()
    sd = gqa.state_dict()
    h, hkv, d = TINY_LLAMA.n_heads, TINY_LLAMA.kv_heads, TINY_LLAMA.dim_head
    for i in range(TINY_LLAMA.n_layers):
        w = sd[f"blocks.{i}.attn.qkv_proj.weight"]
        q, k, v = w.split([h * d, hkv * d, hkv * d])
        rep = lambda x: x.view(hkv, d, -1).repeat_interleave(h // hkv, 0).reshape(h * d, -1)
        sd[f"blocks.{i}.attn.qkv_proj.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(sd)
    x = torch.randint(0, TINY_LLAMA.vocab_size, (2, 10))
    assert (gqa(x) - mha(x)).abs().max().item() <= 1e-5


def test_rope_depends_only_on_relative_position():
    rope = RotaryEmbedding(16, 256, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([[pq]]), torch.float32)
        ck, sk = rope(torch.tensor([[pk]]), torch.float32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    base = score(10, 3)
    for shift in (1, 17, 100):
        assert abs(score(10 + shift, 3 + shift) - base) < 1e-4
    assert abs(score(10, 4) - base) > 1e-4


def test_slot_reuse_leaks_nothing(model):
    V = model.cfg.vocab_size
    cache = model.new_cache(2, 64)
    long = torch.randint(0, V, (1, 40))
    model(long, torch.arange(40)[None], cache, [1])  # fill slot 1 far beyond what comes next
    short = torch.randint(0, V, (1, 6))
    reused = model(short, torch.arange(6)[None], cache, [1])
    fresh = model(short)
    assert (reused - fresh).abs().max().item() <= 1e-5
    nxt = torch.randint(0, V, (1, 1))
    step = model(nxt, torch.tensor([[6]]), cache, [1])[0, 0]
    ref = model(torch.cat([short, nxt], 1))[0, -1]
    assert (step - ref).abs().max().item() <= 1e-5


def test_copy_slots_duplicates_a_sequence(model):
    V = model.cfg.vocab_size
    cache = model.new_cache(3, 32)
    s = torch.randint(0, V, (1, 8))
    model(s, torch.arange(8)[None], cache, [0])
    cache.copy_slots([0], [2])
    nxt = torch.randint(0, V, (1, 1))
    a = model(nxt, torch.tensor([[8]]), cache, [0])
    b = model(nxt, torch.tensor([[8]]), cache, [2])
    assert torch.equal(a, b)


@pytest.mark.parametrize("src,dst", [([5, 2], [2, 5]),            # swap
                                     ([0, 1, 2], [1, 2, 3]),      # chain: each source is the next's target
                                     ([3, 3, 1], [0, 1, 3]),      # one source to two targets, one overwritten
                                     ([0, 2], [4, 5])])           # disjoint: copied slot by slot
@pytest.mark.parametrize("length", [None, 4, [3, 7, 2]])
def test_copy_slots_reads_every_source_before_writing(src, dst, length):
    """Beam reorders and compaction copy between overlapping slot sets: each target must get its source's old
    data: self-attention K/V up to `length` (one for all, or one per copy), cross K/V up to the source's length."""
    from model.kv_cache import KVCache

    torch.manual_seed(0)
    cache = KVCache(2, 6, 2, 8, 4, cross_len=5)
    for buf in (cache.k, cache.v, cache.cross_k, cache.cross_v):
        buf.copy_(torch.randn_like(buf))
    cache.src_len.copy_(torch.tensor([5, 2, 4, 1, 3, 5]))
    before = {n: getattr(cache, n).clone() for n in ("k", "v", "cross_k", "cross_v", "src_len")}
    if isinstance(length, list):
        length = length[:len(src)]
    cache.copy_slots(src, dst, length=length)
    lengths = length if isinstance(length, list) else [8 if length is None else length] * len(src)
    for s, d, m in zip(src, dst, lengths, strict=True):
        for n in ("k", "v"):
            assert torch.equal(getattr(cache, n)[:, d, :, :m], before[n][:, s, :, :m]), (n, s, d)
        for n in ("cross_k", "cross_v"):
            n_src = int(before["src_len"][s])
            assert torch.equal(getattr(cache, n)[:, d, :, :n_src], before[n][:, s, :, :n_src]), (n, s, d)
        assert cache.src_len[d] == before["src_len"][s]
    untouched = [i for i in range(6) if i not in dst]
    assert torch.equal(cache.k[:, untouched], before["k"][:, untouched])


def test_position_beyond_cache_is_a_clear_error(model):
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[8]]), cache, [0])


def _smaps_kb_at(address: int, field: str) -> int:
    """`field` (AnonHugePages, Rss, ...) of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    return 0


def _huge_kb_at(address: int) -> int:
    return _smaps_kb_at(address, "AnonHugePages")


@pytest.mark.parametrize("huge", ["1", "0"])
def test_cache_buffers_are_zeros_and_ask_for_huge_pages(huge, monkeypatch):
    """A large CPU cache buffer is zeros of its shape and dtype either way; asked for (the default), it
    lives on transparent huge pages where the kernel offers them (`madvise` mode or `always`)."""
    import gc
    import sys

    from model.kv_cache import cache_buffer

    monkeypatch.setenv("ATTNSERVE_HUGE_PAGES", huge)
    t = cache_buffer((64, 1024, 64), torch.bfloat16, "cpu")  # 8 MB
    if sys.platform == "linux" and huge == "1":  # not touched yet: a start does not fault in the whole cache
        assert _smaps_kb_at(t.data_ptr(), "Rss") < 1024
    assert t.shape == (64, 1024, 64) and t.dtype == torch.bfloat16 and not t.any()
    t.add_(1)  # every page written, as a cache in use
    t[-1, -1, -1] = 3.0  # written through, and still there after the buffer's other names are gone
    gc.collect()
    assert t[-1, -1, -1].item() == 3.0 and (t == 1).sum().item() == t.numel() - 1
    if sys.platform != "linux":
        return
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if huge == "1" and "[never]" not in thp:
        assert _huge_kb_at(t.data_ptr()) >= 4096  # of 8 MB: all but the unaligned ends
    if huge == "0" and "[madvise]" in thp:
        assert _huge_kb_at(t.data_ptr()) == 0
