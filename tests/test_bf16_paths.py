"""The serving dtype path: bf16 weights with a bf16 KV cache (`kv_dtype: auto` on a bf16 host) or a
float32 one, through the model's cached forward and through the compiled engines' decode step.

Reference: a float32 recompute, without a cache, of the same bf16-rounded weights. The error measure
is max |got - ref| / max |ref| over all logits. Weights are drawn with std 0.3 (not the 0.02 init) so
that attention is peaked, as in a trained model; with near-uniform attention a wrong position or a
stale key changes the logits too little for any tolerance to tell.

Tolerances are three times the largest error measured over seeds 0-2, either cache dtype and either
path (gpt2 0.024, llama 0.039); the mutations below give 0.9-1.5. The `mutated` cases assert that
each exceeds twice the tolerance, so a tolerance loose enough to let one through fails the suite:
- `position`: every cached decode step at position t + 1 instead of t (RoPE rotates keys and queries
  by the wrong angle; learned positions add the wrong row);
- `slot`: the decode rows read each other's slots;
- `mask`: each row attends one key too far, over stale K/V a previous occupant left in the slot.
"""

from __future__ import annotations

import pytest
import torch

from model.config import TINY_GPT2, TINY_LLAMA
from model.decoder import DecoderLM
from model.decoder_step import decoder_step
from model.kv_cache import CacheContext, StepContext

torch.set_num_threads(1)
CONFIGS = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}
TOLERANCE = {"gpt2": 0.07, "llama": 0.12}
PROMPT, TOTAL = 8, 24  # prefill 8 tokens, then decode one at a time to 24
MUTATIONS = ["position", "slot", "mask"]


def _models(cfg, seed: int) -> tuple[DecoderLM, DecoderLM]:
    """(bf16 model, float32 model holding the same bf16-rounded weights)."""
    torch.manual_seed(seed)
    m = DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 if "embed" in name else 0.3)
    m16 = m.to(torch.bfloat16)
    m32 = DecoderLM(cfg).eval()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    return m16, m32


def _stale_cache(m16: DecoderLM, kv_dtype: torch.dtype, g: torch.Generator):
    cache = m16.new_cache(4, 32, dtype=kv_dtype)
    for buf in (cache.k, cache.v):  # what a slot's previous occupant left behind
        buf.copy_((torch.randn(buf.shape, generator=g) * 3).to(buf.dtype))
    return cache


def _mask_one_too_far(self: CacheContext) -> torch.Tensor:
    self.length = min(self.length + 1, self.cache.max_len)
    ar = torch.arange(self.length, device=self.positions.device)
    return (ar[None, None, :] <= self.positions[:, :, None] + 1)[:, None]


def _step_mask_one_too_far(self: StepContext) -> torch.Tensor:
    keys = torch.arange(self.k.shape[3], device=self.positions.device)
    return (keys[None, :] <= self.positions[:, None])[:, None, None, :]  # the (stale) key at its position too


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@torch.inference_mode()
def forward_error(name: str, kv_dtype: torch.dtype, slots: list[int], mutation: str | None = None,
                  seed: int = 0, weights: torch.dtype = torch.bfloat16) -> float:
    """Two rows prefilled then decoded token by token through DecoderLM.forward with the slot cache
    (`weights`: the serving model's dtype; float32 with a bf16 cache is `kv_dtype: bfloat16` on an fp32 host)."""
    cfg = CONFIGS[name]
    m16, m32 = _models(cfg, seed)
    ref32, m16 = m32, (m16 if weights == torch.bfloat16 else _models(cfg, seed)[1])
    g = torch.Generator().manual_seed(seed + 100)
    seq = torch.randint(0, cfg.vocab_size, (2, TOTAL), generator=g)
    ref = ref32(seq)  # (2, TOTAL, V)
    cache = _stale_cache(m16, kv_dtype, g)
    out = [m16(seq[:, :PROMPT], torch.arange(PROMPT).expand(2, PROMPT), cache, slots)]
    with pytest.MonkeyPatch.context() as mp:
        if mutation == "mask":
            mp.setattr(CacheContext, "self_mask", _mask_one_too_far)
        for t in range(PROMPT, TOTAL):
            pos = t + 1 if mutation == "position" else t
            rows = slots[::-1] if mutation == "slot" else slots
            out.append(m16(seq[:, t:t + 1], torch.full((2, 1), pos), cache, rows))
    got = torch.cat(out, 1)  # (2, TOTAL, V)
    assert got.dtype == weights and cache.k.dtype == kv_dtype
    return _relative_error(got, ref)


@torch.inference_mode()
def step_error(name: str, kv_dtype: torch.dtype, mutation: str | None = None, seed: int = 0,
               weights: torch.dtype = torch.bfloat16) -> float:
    """Two rows prefilled by the forward, then decoded by `decoder_step` over prefix views of slots 0-1
    (strided views: the bf16 `.contiguous()` branch of the attention)."""
    cfg = CONFIGS[name]
    m16, m32 = _models(cfg, seed)
    if weights == torch.float32:
        m16 = _models(cfg, seed)[1]
    g = torch.Generator().manual_seed(seed + 100)
    seq = torch.randint(0, cfg.vocab_size, (2, TOTAL), generator=g)
    ref = m32(seq)[:, PROMPT:]  # (2, TOTAL - PROMPT, V)
    cache = _stale_cache(m16, kv_dtype, g)
    m16(seq[:, :PROMPT], torch.arange(PROMPT).expand(2, PROMPT), cache, [0, 1])
    out = []
    with pytest.MonkeyPatch.context() as mp:
        if mutation == "mask":
            mp.setattr(StepContext, "self_mask", _step_mask_one_too_far)
        for t in range(PROMPT, TOTAL):
            positions = torch.full((2,), t)
            k, v = cache.prefix_views(2, t + 2)  # one more key than needed: masked
            assert not k.is_contiguous()
            if mutation == "slot":
                k, v = k.flip(1), v.flip(1)
            step_pos = positions + 1 if mutation == "position" else positions
            logits, new_k, new_v = decoder_step(m16, seq[:, t], step_pos, k, v)
            cache.write_step(new_k, new_v, positions)
            out.append(logits)
    got = torch.stack(out, 1)  # (2, TOTAL - PROMPT, V)
    assert got.dtype == weights and cache.k.dtype == kv_dtype
    return _relative_error(got, ref)


KV = {"bf16_cache": torch.bfloat16, "fp32_cache": torch.float32}


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("slots", [[2, 3], [3, 0]], ids=["contiguous", "scattered"])
def test_cached_forward_in_bf16_matches_fp32_recompute(name, kv, slots):
    for seed in range(3):
        assert forward_error(name, KV[kv], slots, seed=seed) < TOLERANCE[name]


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_step_in_bf16_matches_fp32_recompute(name, kv):
    for seed in range(3):
        assert step_error(name, KV[kv], seed=seed) < TOLERANCE[name]


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mutated_forward_fails_the_comparison(name, kv, mutation):
    """The tolerance rejects a wrong position, a wrong slot and a wrong mask on the cached forward."""
    for slots in ([2, 3], [3, 0]):
        assert forward_error(name, KV[kv], slots, mutation) > 2 * TOLERANCE[name], (slots, mutation)


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mutated_decode_step_fails_the_comparison(name, kv, mutation):
    assert step_error(name, KV[kv], mutation) > 2 * TOLERANCE[name], mutation


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_weights_with_a_bf16_cache_match_fp32_recompute(name, monkeypatch):
    """`kv_dtype: bfloat16` under float32 weights: K/V stored in bf16, attention computed in float32 over
    the prompt (not in a bf16 the CPU may only emulate), the decode kernel summing in float32."""
    import torch.nn.functional as F

    sdpa_dtypes = set()
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        sdpa_dtypes.add((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for seed in range(2):
        assert forward_error(name, torch.bfloat16, [3, 0], seed=seed, weights=torch.float32) < TOLERANCE[name]
        assert step_error(name, torch.bfloat16, seed=seed, weights=torch.float32) < TOLERANCE[name]
    assert sdpa_dtypes == {(torch.float32,) * 3}
    mutated = forward_error(name, torch.bfloat16, [3, 0], mutation="mask", weights=torch.float32)
    assert mutated > 2 * TOLERANCE[name]
