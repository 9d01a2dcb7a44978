"""Masked grouped-query SDPA: the K/V-repeating form (what CUDA's fused kernels take) equals the
`enable_gqa` form and plain attention math, head for head."""

import pytest
import torch

from model.attention import sdpa


def _reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf")) if mask is not None else s
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_expanded_kv_equals_grouped_heads(h, hkv, masked):
    g = torch.Generator().manual_seed(0)
    b, t, s, d = 2, 5, 7, 16
    q, k, v = (torch.randn(b, n, length, d, generator=g) for n, length in ((h, t), (hkv, s), (hkv, s)))
    # causal over the last t of s keys, and row 1 padded on its first two keys
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
    mask[1, ..., :2] = False
    mask = mask if masked else None
    want = _reference(q, k, v, mask)
    for expand in (False, True):
        torch.testing.assert_close(sdpa(q, k, v, mask, expand_kv=expand), want, atol=1e-5, rtol=1e-5)


def test_query_heads_map_to_their_own_kv_head():
    # each K/V head carries a distinct constant value: query head i must read K/V head i // group
    b, h, hkv, t, d = 1, 6, 3, 4, 8
    q, k = torch.zeros(b, h, t, d), torch.zeros(b, hkv, t, d)
    v = torch.arange(hkv, dtype=torch.float32).view(1, hkv, 1, 1).expand(b, hkv, t, d).contiguous()
    mask = torch.ones(b, 1, t, t, dtype=torch.bool).tril()
    out = sdpa(q, k, v, mask, expand_kv=True)  # (B, H, T, D)
    assert out[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
