"""attnserve::prefix_attention's C++ kernel against its torch twin: shapes, dtypes, masks, strided cache views
and each instruction-set path."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from model import native_ops
from model.attention import decode_attention, prefix_attention
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def native():
    assert native_ops.load(), "the C++ kernels did not build (make install brings g++ and ninja)"


def reference(q, k, v, k_new, v_new, ok):
    """The torch code: `decode_attention` with the row's own key and value."""
    return decode_attention(q, k, v, ok, (k_new, v_new))


def _inputs(r, h, hkv, length, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(r, hkv, length + 37, d, generator=g).to(dtype)  # the slot cache: longer than L
    cache_v = torch.randn(r, hkv, length + 37, d, generator=g).to(dtype)
    qkv = torch.randn(r, 1, (h + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[..., :h * d].view(r, 1, h, d).transpose(1, 2)  # (R, H, 1, D), strided as the model's
    k_new = torch.randn(r, hkv, 1, d, generator=g).to(dtype)
    v_new = torch.randn(r, hkv, 1, d, generator=g).to(dtype)
    positions = torch.randint(0, length + 1, (r,), generator=g)
    positions[0] = 0  # a row with no cached key attends only its own
    ok = (torch.arange(length)[None, :] < positions[:, None])[:, None, None, :]
    return q, cache_k[:, :, :length], cache_v[:, :, :length], k_new, v_new, ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h, hkv, d", [(9, 3, 64), (4, 4, 32), (8, 2, 24), (12, 1, 16)])
@pytest.mark.parametrize("r, length", [(1, 1), (3, 40), (5, 129)])
def test_kernel_matches_the_torch_code(dtype, h, hkv, d, r, length):
    args = _inputs(r, h, hkv, length, d, dtype)
    got = prefix_attention(*args)
    ref = reference(*[a.float() if a.is_floating_point() else a for a in args])
    assert got.dtype == dtype and got.shape == (r, h, 1, d)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)
    v_new = args[4]
    g = h // hkv
    assert torch.equal(got[0], v_new[0].repeat_interleave(g, 0))  # only its own key: exactly its value


def test_mask_of_one_row_serves_every_row_and_masked_keys_do_not_count():
    q, k, v, k_new, v_new, ok = _inputs(4, 9, 3, 50, 64, torch.float32)
    ok = torch.ones(1, 1, 1, 50, dtype=torch.bool)
    ok[..., 20:] = False
    got = prefix_attention(q, k, v, k_new, v_new, ok)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:], v2[:, :, 20:] = 1e4, float("nan")  # whatever sits past the mask is never read into sums
    assert torch.equal(prefix_attention(q, k2, v2, k_new, v_new, ok), got)
    assert torch.allclose(got, reference(q, k, v, k_new, v_new, ok), atol=1e-5)


def test_bad_shapes_are_refused():
    q, k, v, k_new, v_new, ok = _inputs(2, 9, 3, 10, 64, torch.float32)
    with pytest.raises(RuntimeError, match="prefix_ok"):
        torch.ops.attnserve.prefix_attention(q, k, v, k_new, v_new, ok.int())
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.attnserve.prefix_attention(q[:, :8], k, v, k_new, v_new, ok)


_PATH_OUTPUT = """
import torch
from model import native_ops
from model.attention import decode_attention, prefix_attention
assert native_ops.load(), "the C++ kernels did not build"
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    for h, hkv, d in ((9, 3, 64), (8, 2, 24), (2, 2, 64), (6, 1, 32)):  # key and slice blocks by G
        args = _inputs(6, h, hkv, 77, d, dtype, seed=1)
        args[5][1, ..., 3:60:7] = False  # holes in a row's prefix: skipped in the middle of key blocks
        ref = reference(*[a.float() if a.is_floating_point() else a for a in args])
        worst = max(worst, (prefix_attention(*args).float() - ref).abs().max().item())
print(worst)
"""


@pytest.mark.parametrize("isa", ["", "avx2", "scalar"])
def test_kernel_paths_agree_with_the_torch_code(isa):
    """AVX-512, AVX2 or plain C++ is picked at run time; ATTNSERVE_ISA caps it so each path this host can
    run is checked."""
    env = dict(os.environ, ATTNSERVE_ISA=isa, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = inspect.getsource(reference) + inspect.getsource(_inputs) + _PATH_OUTPUT
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout) < 2e-2


def test_a_float16_cache_takes_the_torch_code():
    """`kv_dtype: float16` on CPU: the kernel reads float32 and bfloat16 only, so the torch code attends
    (it refused, and every translator decode step, whose cross-attention takes this path, failed)."""
    args = _inputs(3, 9, 3, 20, 64, torch.float16)
    got = prefix_attention(*args)
    assert got.dtype == torch.float16 and torch.equal(got, reference(*args))
