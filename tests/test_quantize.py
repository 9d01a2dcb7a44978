"""Quantized linears (model/quantize.py): close to float, row-independent, Q4_1 groups recovered,
swapped into a model for eager and compiled execution, chosen by the service config."""

import pytest
import torch
from torch import nn

from model.config import DecoderConfig
from model.decoder import DecoderLM
from model.quantize import (
    Int4Linear,
    Int8Linear,
    Q8Linear,
    choose_quantization,
    int4_head,
    int4_linear_reference,
    prepacked_linear,
    q8_linear_reference,
    quantization_of,
    quantize_decoder,
    quantize_linears,
    unpack_int4,
    unpack_q8,
)


def _linear(k=64, n=48, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


def test_int8_close_to_float_and_rows_independent():
    lin = _linear()
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    x[2] *= 40  # one row far larger than the others: per-tensor scales would drown the rest
    ref = lin(x)
    y = q(x)
    rel = (y - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.03, rel
    for r in range(5):  # each row alone gives exactly what it gave in the batch
        assert torch.equal(q(x[r:r + 1]), y[r:r + 1])


_INT8_OUTPUT = """
import sys, torch
from torch import nn
from model import native_ops
from model.quantize import Int8Linear
torch.manual_seed(0)
lin = nn.Linear(64, 48)
x = torch.randn(7, 64)
with torch.inference_mode():
    y = Int8Linear(lin)(x)
print(native_ops.load(), y.sum().item(), y.abs().sum().item())
"""


def test_int8_kernel_is_native_and_equals_the_python_kernel():
    """Where g++ is found the int8 op's CPU kernel is the C++ one (no GIL inside a compiled step); it
    computes exactly what the Python kernel (ATTNSERVE_NATIVE=0) computes."""
    import os
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    assert shutil.which("g++") or shutil.which("c++"), "no C++ compiler: the native int8 kernel cannot be built"
    out = {}
    for native in ("1", "0"):
        env = dict(os.environ, ATTNSERVE_NATIVE=native, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", _INT8_OUTPUT], env=env, capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        out[native] = r.stdout.split()
    assert out["1"][0] == "True" and out["0"][0] == "False"
    assert out["1"][1:] == out["0"][1:]


_LOAD_CUT_LIBRARY = """
import sys, torch.utils.cpp_extension
from model import native_ops
builds = []

def build(name, sources, build_directory, **kwargs):
    builds.append(build_directory)
    raise RuntimeError("no compiler on this host")  # and so the Python kernels serve

torch.utils.cpp_extension.load = build
so = native_ops.build_dir() / "attnserve_native.so"
so.parent.mkdir(parents=True)
so.write_bytes(open(sys.argv[1], "rb").read()[:int(sys.argv[2])])
print(native_ops.load(), builds == [str(so.parent)], so.exists())
"""


@pytest.mark.parametrize("cut", [20, 4096])  # not an ELF file; an ELF header without the rest
def test_a_native_library_cut_short_is_built_again(tmp_path, cut):
    """A build killed while linking leaves a file that is not the whole library: the next start builds it
    again (it fell back to the Python kernels on every start, or died of SIGBUS in dlopen)."""
    import os
    import subprocess
    import sys

    from model import native_ops
    from tests.conftest import ROOT

    assert native_ops.load()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("ATTNSERVE_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", _LOAD_CUT_LIBRARY, str(native_ops.build_dir() / "attnserve_native.so"),
                        str(cut)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True", "False"]  # the build was tried, the cut file removed


def test_int8_smoothing_uses_calibration_maxima():
    lin = _linear(bias=False)
    x = torch.randn(8, 64)
    x[:, 3] *= 60  # an outlier input channel, as SmolLM2's layers have
    plain = (Int8Linear(lin)(x) - lin(x)).norm()
    smooth = (Int8Linear(lin, act_max=x.abs().amax(0))(x) - lin(x)).norm()
    assert smooth < plain


def test_int8_smoothing_factors_stay_float32_when_the_model_is_cast():
    """The engine casts a quantized model to bf16; the smoothing factors the weights were scaled by must
    stay exact (rounded to bf16 they made SmolLM2 answer nonsense)."""
    lin = _linear(bias=False)
    x = torch.randn(8, 64)
    x[:, 3] *= 60
    q = Int8Linear(lin, act_max=x.abs().amax(0))
    exact = q.inv_smooth.clone()
    want = q(x.to(torch.bfloat16))
    model = nn.Sequential(q).to(torch.bfloat16)
    assert q.inv_smooth.dtype == torch.float32 and torch.equal(q.inv_smooth, exact)
    assert torch.equal(model(x.to(torch.bfloat16)), want)


def _q4_1_linear(n=32, k=64, seed=0):
    """A linear whose weights are built the way a Q4_1 block stores them: fp16 minimum + fp16 scale x q,
    q in 0..15, both ends present -> (linear, q, scale, minimum)."""
    torch.manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    scale = (torch.rand(n, k // 32) * 0.01 + 0.001).half().float()
    low = (torch.randn(n, k // 32) * 0.01).half().float()
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_((low[..., None] + scale[..., None] * q).view(n, k))
    return lin, q.view(n, k), scale, low


def test_int4_recovers_q4_1_groups_exactly():
    lin, q, scale, low = _q4_1_linear()
    got_q, got_scale, got_low = unpack_int4(Int4Linear(lin).packed)
    assert torch.equal(got_q.long(), q) and torch.equal(got_scale, scale) and torch.equal(got_low, low)


def test_int4_kernel_matches_its_reference_close_to_float_and_rows_independent():
    lin, *_ = _q4_1_linear(n=48, k=96)
    layer = Int4Linear(lin)
    x = torch.randn(11, 96)  # more rows than the kernel's register block of 8
    x[3] *= 40
    y = layer(x)
    assert torch.allclose(y, int4_linear_reference(x, layer.packed, 48), rtol=1e-5, atol=1e-5)
    ref = lin(x)
    assert ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.02  # int8 activations per group of 32
    for r in range(11):
        assert torch.equal(layer(x[r:r + 1]), y[r:r + 1])
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_q8_recovers_q8_0_groups_exactly():
    torch.manual_seed(4)
    n, k = 32, 64
    q = torch.randint(-127, 128, (n, k // 32, 32))
    q[..., 0] = 127 * torch.randint(0, 2, (n, k // 32)) * 2 - 127  # each group reaches +-127, as Q8_0's do
    scale = (torch.rand(n, k // 32) * 0.01 + 1e-4).to(torch.float16).float()
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_((scale[..., None] * q).view(n, k))
    got_q, got_scale = unpack_q8(Q8Linear(lin).packed)
    assert torch.equal(got_q.long(), q.view(n, k)) and torch.equal(got_scale, scale)


def test_q8_kernel_matches_its_reference_close_to_float_and_rows_independent():
    lin = _linear(k=96, n=48)
    layer = Q8Linear(lin)
    x = torch.randn(11, 96)  # more rows than the kernel's register block of 8
    x[3] *= 40
    with torch.inference_mode():
        y = layer(x)
        assert torch.allclose(y, q8_linear_reference(x, layer.packed, 48) + layer.bias, rtol=1e-5, atol=1e-5)
        ref = lin(x)
        assert ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.01  # int8 weights and activations a group
        for r in range(11):
            assert torch.equal(layer(x[r:r + 1]), y[r:r + 1])
        xb = x.bfloat16()
        yb = layer(xb)
        assert yb.dtype == torch.bfloat16
        want = (q8_linear_reference(xb.float(), layer.packed, 48) + layer.bias).bfloat16()
        assert torch.allclose(yb.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("cls", "reference"), [(Int4Linear, int4_linear_reference), (Q8Linear, q8_linear_reference)])
def test_int4_and_q8_take_float16_inputs(cls, reference):
    """`dtype: float16` on CPU: the C++ kernels read float32 and bfloat16, so a float16 input is read as
    float32, as the Python kernels read it (the C++ ones refused it: an int4 model in float16 failed to load)."""
    layer = cls(_linear(k=96, n=48))
    x = torch.randn(5, 96).half()
    with torch.inference_mode():
        y = layer(x)
        want = (reference(x.float(), layer.packed, 48) + layer.bias).half()
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, want, rtol=1e-3, atol=1e-3)


_INT4_OUTPUT = """
import torch
from torch import nn
from model import native_ops
from model.quantize import Int4Linear, Q8Linear, int4_linear_reference, q8_linear_reference
torch.manual_seed(0)
layer, q8 = Int4Linear(nn.Linear(128, 64)), Q8Linear(nn.Linear(128, 64))
assert native_ops.load(), "the C++ kernels did not build"
x = torch.randn(9, 128)
with torch.inference_mode():
    print(max((layer(x) - int4_linear_reference(x, layer.packed, 64) - layer.bias).abs().max().item(),
              (q8(x) - q8_linear_reference(x, q8.packed, 64) - q8.bias).abs().max().item()))
"""


@pytest.mark.parametrize("isa", ["", "avx2", "scalar"])
def test_int4_and_q8_kernel_paths_agree_with_the_reference(isa):
    """The C++ kernels pick AVX-512 VNNI, AVX2 or plain C++ at run time; ATTNSERVE_ISA caps the choice so
    each path this host can run is checked."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, ATTNSERVE_ISA=isa, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _INT4_OUTPUT], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout) < 1e-4


def tiny_llama(d_ff: int = 128):
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=d_ff, max_seq_len=64,
                        norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias=False, mlp_bias=False,
                        tie_embeddings=True)
    return DecoderLM(cfg).eval()


class TinyTok:
    def encode(self, text):
        return [b % 96 for b in text.encode()[:48]]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_close_and_compiles(mode, one_torch_thread):
    model = tiny_llama()
    tokens = torch.randint(0, 96, (2, 12))
    with torch.inference_mode():
        ref = model(tokens)
    n = quantize_decoder(model, TinyTok(), mode)
    assert n == 2 * 4 + 1  # qkv, o, gate_up, down per block + lm_head
    kinds = {type(m) for m in model.modules()}
    assert type(model.lm_head) is (int4_head() if mode == "int4" else Int8Linear)
    assert (mode == "int8") == (Int4Linear not in kinds)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.inference_mode():
        out = model(tokens)
        compiled = torch.compile(model)(tokens)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert torch.allclose(compiled, out, atol=1e-3, rtol=1e-3)


def test_int4_leaves_no_float_linear_where_int4_cannot_take_one(one_torch_thread):
    model = tiny_llama(d_ff=136)  # down's 136 inputs are not whole groups of 32: int8 takes it
    n = quantize_decoder(model, TinyTok(), "int4")
    assert n == 2 * 4 + 1
    assert type(model.lm_head) is int4_head() and type(model.blocks[0].mlp.down) is Int8Linear
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert quantization_of(model) == "int4"


def test_quantize_rejects_unknown_mode_and_keeps_named_layers():
    model = tiny_llama()
    with pytest.raises(ValueError, match="quantization"):
        quantize_linears(model, "int3")
    assert quantize_linears(model, "int8", keep=("lm_head",)) == 8
    assert isinstance(model.lm_head, nn.Linear)


def test_auto_picks_a_mode_and_service_config_validates():
    from service.config import ModelSpec

    assert choose_quantization() in ("none", "int8", "int4")
    assert choose_quantization(torch.float32, True) in ("none", "int8", "int4")
    assert ModelSpec.from_dict({"quantization": "int8"}).quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        ModelSpec.from_dict({"quantization": "fp8"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_computes_the_linear(dtype):
    """'auto' times float linears as a frozen compiled step runs them: the same function, prepacked."""
    lin = _linear(64, 48).to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    with torch.inference_mode():
        got, want = prepacked_linear(lin, 16)(x), lin(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("mode", "packages"), [("int8", ["blocks", "head"]),
                                               ("int4", ["blocks", "head", "prefill"]),
                                               ("int4 q8 head", ["blocks", "head", "prefill"]),
                                               ("int8 float head", ["decode"])])
def test_quantized_step_from_shared_packages_equals_the_eager_step(mode, packages, tmp_path, monkeypatch,
                                                                   one_torch_thread):
    """A quantized decoder's compiled step runs one package for every run of layers (each run's weights
    as inputs) and one for the head; a model with float linears left, one frozen package of the whole
    step. Either way its logits and new K/V equal the eager step's, for one row (no pad row) and for
    ragged rows with a pad row among them. A quantized one's prompt chunks go through a package of the runs
    of layers too, writing what the eager forward writes."""
    from model.decoder_step import decoder_step
    from service.engine.compiled import CompiledDecoder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    m = tiny_llama()
    if mode == "int8 float head":
        quantize_linears(m, "int8", keep=("lm_head",))
    elif mode == "int4 q8 head":  # the head of int4 on CPUs without VNNI, on any host
        quantize_linears(m, "int4", keep=("lm_head",))
        m.lm_head = Q8Linear(m.lm_head)
    else:
        quantize_decoder(m, TinyTok(), mode)
    cache = m.new_cache(8, 64)
    prompts = [[5, 9, 11, 3], [7, 2], [1, 2, 3, 4, 5, 6, 7]]
    with torch.inference_mode():
        for slot, p in enumerate(prompts):
            m(torch.tensor([p]), torch.arange(len(p))[None], cache, slots=[slot])
    step = CompiledDecoder(m, cache)
    step.warm_up(build_prefill="prefill" in packages)  # the prefill package as the service runs it: int4
    built = sorted(p.name.split("-")[1] for p in (tmp_path / "aoti").glob("*.pt2"))
    assert built == packages
    for slots in ([0], [0, 2]):  # slot 1 is a pad row in the second
        tokens, positions = [40 + s for s in slots], [len(prompts[s]) for s in slots]
        n = slots[-1] + 1
        all_tokens, all_positions = [0] * n, [0] * n
        for s, t, q in zip(slots, tokens, positions, strict=True):
            all_tokens[s], all_positions[s] = t, q
        with torch.inference_mode():
            k, v = cache.prefix_views(n, max(positions))
            ref, ref_k, ref_v = decoder_step(m, torch.tensor(all_tokens), torch.tensor(all_positions), k.clone(),
                                             v.clone())
            got = step.decode(slots, tokens, positions)
        assert torch.allclose(got, ref[slots], atol=1e-4, rtol=1e-4)
        for s, q in zip(slots, positions, strict=True):
            assert torch.allclose(cache.k[:, s, :, q], ref_k[:, s], atol=1e-5)
            assert torch.allclose(cache.v[:, s, :, q], ref_v[:, s], atol=1e-5)
    if "prefill" not in packages:
        assert step.prefill_pending == (mode == "int8") and step.prefill(3, [8, 1], 0) is None  # eager prefill
        if mode == "int8":  # weights of another dtype (an engine casting buffers) get their own graph
            for mod in m.modules():
                if isinstance(mod, Int8Linear):
                    mod.inv_smooth = mod.inv_smooth.to(torch.bfloat16)
            CompiledDecoder(m, cache).warm_up(build_prefill=False)
            assert len(list((tmp_path / "aoti").glob("*.pt2"))) == 4  # rebuilt: blocks and head
        return
    # a chunk at the start of a slot, a lone token (padded to two), a chunk after a cached prefix
    for slot, chunk, start in ((3, [8, 1, 4, 4, 9], 0), (4, [6], 0), (1, [12, 13, 14], len(prompts[1]))):
        ref = m.new_cache(8, 64)
        ref.k.copy_(cache.k)
        ref.v.copy_(cache.v)
        with torch.inference_mode():
            want = m(torch.tensor([chunk]), torch.arange(start, start + len(chunk))[None], ref, slots=[slot])[0, -1]
            got = step.prefill(slot, chunk, start)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        end = start + len(chunk)
        assert torch.allclose(cache.k[:, slot, :, :end], ref.k[:, slot, :, :end], atol=1e-5)
        assert torch.allclose(cache.v[:, slot, :, :end], ref.v[:, slot, :, :end], atol=1e-5)
    assert step.prefill(5, [1, 2], 63) is None  # past the cache's end: the eager forward's to refuse
    # a replica's first start: no prefill package yet, the step serves without one until it is built
    package = next((tmp_path / "aoti").glob("decoder-prefill-*.pt2"))
    package.rename(tmp_path / "kept.pt2")
    later = CompiledDecoder(m, cache)
    later.warm_up(build_prefill=False)
    assert later.prefill_pending and later.prefill(3, [8, 1], 0) is None
    assert not later.load_prefill()  # not built: nothing to load
    (tmp_path / "kept.pt2").rename(package)  # as a child process builds it
    assert later.load_prefill() and not later.prefill_pending


_COMPILE_TWICE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
sys.path.insert(0, {root!r})
from tests.test_quantize import tiny_llama, TinyTok
from tests.engine_util import tiny_seq2seq
from model.quantize import quantize_decoder
from service.engine.compiled import CompiledDecoder, CompiledTranslator, use_persistent_cache
torch.set_num_threads(1)
m = tiny_llama()
quantize_decoder(m, TinyTok(), "int8")
step = CompiledDecoder(m, m.new_cache(8, 64))
step.warm_up(build_prefill=False)
with torch.inference_mode():
    logits = step.decode([0, 1, 2], [5, 6, 7], [0, 0, 0])
t = tiny_seq2seq()
tr = CompiledTranslator(t, t.new_cache(8, 32, cross_len=t.cfg.max_src_len + 1))
tr.warm_up()
with torch.inference_mode():
    tr.encode([[3, 9, 10, 2], [4, 11, 2]], [1, 1], [0, 1])
    out = tr.decode([1, 1], [0, 0], [4, 3])
d = use_persistent_cache()
print(d, len(list((d / "aoti").glob("*.pt2"))), repr(logits.float().sum().item()), repr(out.float().sum().item()))
"""


def test_second_start_loads_compiled_steps_from_attnserve_home(tmp_path):
    """Compiled steps (a quantized decoder's, the translator's frozen ones) are stored under
    $ATTNSERVE_HOME/compile as AOTInductor packages and loaded, not compiled, by the next process, with
    the same outputs."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(ATTNSERVE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    code = _COMPILE_TWICE.format(root=str(ROOT))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split()[-4:] for r in runs)
    assert first[0] == second[0] and first[0].startswith(str(tmp_path / "compile" / "torch-"))
    assert first[1] == second[1] == "4"  # decoder layers, decoder head; translator step, encoder
    assert first[2:] == second[2:]  # same logits from the built and the loaded packages
    assert runs[0].stderr.count(": built ") == 4 and ": loaded " not in runs[0].stderr
    assert runs[1].stderr.count(": loaded ") == 4 and ": built " not in runs[1].stderr


def test_package_fingerprint_follows_weights_and_quantized_kernels():
    """A compiled package holds the weights as constants: another weight, or int8 kernels under other
    handles, must give another fingerprint (so another package, never a stale one)."""
    from service.engine.aot_package import fingerprint

    a, b = tiny_llama(), tiny_llama()
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.blocks[0].mlp.down.weight[0, 0] += 1e-3
    assert fingerprint(a) != fingerprint(b)
    c, d = tiny_llama(), tiny_llama()
    quantize_decoder(c, TinyTok(), "int8")
    quantize_decoder(d, TinyTok(), "int8")  # same weights, new handles
    assert fingerprint(c) != fingerprint(d)


def test_package_folder_keeps_the_newest_few_per_step(tmp_path):
    import os

    from service.engine.aot_package import KEEP, prune

    for i in range(KEEP + 3):
        for name in ("translator-encode-many", "translator-encode-one"):
            f = tmp_path / f"{name}-{i:04d}.pt2"
            f.write_bytes(b"x")
            os.utime(f, (1000 + i, 1000 + i))
    (tmp_path / "translator-encode-many-0000.123.tmp.pt2").write_bytes(b"x")  # another process's build
    prune(tmp_path, "translator-encode-many", keep_bytes=0)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in left if n.startswith("translator-encode-many-") and "tmp" not in n] == [
        f"translator-encode-many-{i:04d}.pt2" for i in range(3, KEEP + 3)]
    assert sum(n.startswith("translator-encode-one-") for n in left) == KEEP + 3
    assert "translator-encode-many-0000.123.tmp.pt2" in left
    # small packages (a quantized decoder's) stay beyond KEEP while the step's total fits the byte budget:
    # a benchmark of other settings does not evict what the service loads
    prune(tmp_path, "translator-encode-one", keep_bytes=KEEP + 1)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("translator-encode-one-"))
    assert left == [f"translator-encode-one-{i:04d}.pt2" for i in range(2, KEEP + 3)]


def test_frozen_package_prepacks_float_linears(tmp_path):
    """`freezing=True` must reach inductor: it freezes only a graph compiled without autograd, and a package
    built with grad on kept plain matmuls that repack the weights on every call."""
    from torch._dynamo.utils import counters
    from torch.export import Dim

    from service.engine.aot_package import load_or_build

    lin = _linear(64, 48)
    x = torch.randn(5, 64)
    counters.clear()
    step = load_or_build(tmp_path, "linear", lambda m, t: m(t), lin, (x,), ({0: Dim("rows", min=1, max=16)},),
                         freezing=True, key=("test",))
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] >= 1
    (out,) = step(x)
    torch.testing.assert_close(out, lin(x).detach(), rtol=1e-4, atol=1e-5)
