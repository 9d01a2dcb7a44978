"""model/dropout.py: the hash-mask dropout the models train with (C++ kernel on CPU)."""

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model import native_ops
from model.attention import dropout_attention
from model.dropout import Dropout, dropout
from tests.conftest import ROOT


@pytest.fixture
def native():
    assert native_ops.load(), "the C++ kernels did not build (make install brings g++ and ninja)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keeps_one_minus_p_scaled_and_the_backward_uses_the_same_mask(native, dtype):
    x = (torch.rand(257, 1031) + 0.5).to(dtype).requires_grad_()  # no zeros: a zero output means dropped
    y = dropout(x, 0.25)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005
    torch.testing.assert_close(y[kept], (x[kept].float() / 0.75).to(dtype))
    g = torch.randn(x.shape[1], x.shape[0]).to(dtype).t()  # a non-contiguous gradient
    y.backward(g)
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], (g[kept].float() / 0.75).to(dtype))


def test_masks_repeat_under_manual_seed_and_differ_between_calls(native):
    x = torch.ones(64, 1000)
    torch.manual_seed(3)
    a, b = dropout(x, 0.5) != 0, dropout(x, 0.5) != 0
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5) != 0, a)
    agree = (a == b).float().mean().item()
    assert 0.48 < agree < 0.52  # independent masks agree half the time at p = 0.5
    flat = a.flatten().float() - 0.5
    assert abs((flat[1:] * flat[:-1]).mean().item()) < 0.01  # neighbours uncorrelated


def test_identity_in_eval_mode_or_at_p_zero():
    x = torch.randn(4, 8)
    m = Dropout(0.3).eval()
    assert m(x) is x
    assert dropout(x, 0.0) is x


def _outputs():
    x = torch.randn(3, 100_003, generator=torch.Generator().manual_seed(0))
    out = []
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        out.append(dropout(x.to(dt), 0.1).float())
    return out


def test_vector_and_plain_kernels_give_the_same_bits(native, tmp_path):
    """AVX2 is picked at run time; ATTNSERVE_ISA=scalar forces the plain C++ loop: same masks, same rounding,
    over tensors that several threads split."""
    script = ("import sys\nimport torch\nfrom model.dropout import dropout\n" + inspect.getsource(_outputs)
              + "torch.save(_outputs(), sys.argv[1])\n")
    path = tmp_path / "scalar.pt"
    env = dict(os.environ, ATTNSERVE_ISA="scalar", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for ref, out in zip(_outputs(), torch.load(path), strict=True):
        assert torch.equal(ref, out)


def test_torch_dropout_serves_where_the_kernel_is_not_loaded(monkeypatch):
    monkeypatch.setattr(native_ops, "load", lambda: False)
    x = torch.ones(100, 100)
    torch.manual_seed(0)
    y = dropout(x, 0.5)
    torch.manual_seed(0)
    assert torch.equal(y, F.dropout(x, 0.5, True))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_dropout_attention_is_attention_when_nothing_is_dropped(heads):
    h, hkv = heads
    q, k, v = torch.randn(2, h, 5, 8), torch.randn(2, hkv, 7, 8), torch.randn(2, hkv, 7, 8)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != hkv)
    torch.testing.assert_close(dropout_attention(q, k, v, mask, 0.0), ref)


def test_p_one_drops_everything():
    assert not dropout(torch.randn(10, 10), 1.0).any()


def test_float64_keeps_its_precision(native):
    x = torch.full((1000,), 1 + 1e-12, dtype=torch.float64)
    y = dropout(x, 0.5)
    kept = y[y != 0]
    assert len(kept) > 400 and bool((kept > 2.0).all())  # 2 * (1 + 1e-12) is not rounded to 2.0


def test_dropout_attention_drops_the_attention_weights(native):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    torch.manual_seed(11)
    y = dropout_attention(q, k, v, mask, 0.3)
    torch.manual_seed(11)
    keep = dropout(torch.ones(2, 4, 5, 7), 0.3)  # the same seed: the same mask, times the scale
    w = torch.softmax((q @ k.transpose(-1, -2)) * 8 ** -0.5, dim=-1)
    torch.testing.assert_close(y, (w * keep) @ v)
    assert not torch.allclose(y, w @ v)


def test_a_training_step_with_dropout_runs_the_cpu_paths_and_repeats_under_a_seed(native, monkeypatch):
    from model import attention
    from model.config import TINY_SEQ2SEQ
    from model.seq2seq import EncoderDecoder

    calls = []
    real = attention.dropout_attention
    monkeypatch.setattr(attention, "dropout_attention", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    m = EncoderDecoder(dataclasses.replace(TINY_SEQ2SEQ, dropout=0.1)).train()
    src, tgt = torch.randint(3, 97, (4, 9)), torch.randint(3, 97, (4, 7))
    losses = []
    for _ in range(2):
        torch.manual_seed(5)
        loss = F.cross_entropy(m(src, tgt).flatten(0, 1), tgt.flatten())
        m.zero_grad()
        loss.backward()
        losses.append((loss.item(), m.embed.weight.grad.clone()))
    assert calls  # attention dropped out through our kernel's path
    assert losses[0][0] == losses[1][0] and torch.equal(losses[0][1], losses[1][1])
    assert torch.isfinite(losses[0][1]).all()
    m.eval()
    with torch.no_grad():
        assert not torch.allclose(m(src, tgt), m.train()(src, tgt))
