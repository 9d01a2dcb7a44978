"""Quantized linear layers for CPU decoding: int8 (W8A8) and int4 (group-wise, weight-only).

`quantize_linears(model, mode)` swaps `nn.Linear` modules for drop-in ones, so eager and compiled code both
use them. int8: per-channel weights, activations scaled per row (token) through fbgemm, with SmoothQuant's
per-input-channel smoothing calibrated on `CALIBRATION_TEXT`. int4: llama.cpp's Q4_1 groups of 32 times
int8 activations, in our C++ kernel (its output projection in Q8_0 groups where the CPU lacks VNNI). Why:
docs/decisions.md ("Quantization").
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import time
import warnings
import weakref
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model import native_ops
from model.cpu_features import cpu_flags

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32
SMOOTH_ALPHA = 0.3
CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration_en.txt"

# torch.compile cannot hold fbgemm's packed weights (a TorchScript object) in a graph, so the op takes an
# integer handle to them. Under `handles_as_inputs()` the handle is read from a 0-d buffer instead, so one
# exported graph serves every layer of its shape (service/engine/aot_package.py).
_packed: dict[int, torch.ScriptObject] = {}
_handles = itertools.count(1)
_handle_inputs = False


@contextlib.contextmanager
def handles_as_inputs():
    """While tracing a graph that takes the buffers as inputs: int8 layers read their handle from `handle_id`."""
    global _handle_inputs
    before, _handle_inputs = _handle_inputs, True
    try:
        yield
    finally:
        _handle_inputs = before


# A plain `torch.library.Library`, not `custom_op`, whose Python wrapper costs more per call than the op.
_lib = torch.library.Library("attnserve", "DEF")
_lib.define("int8_linear(Tensor x, SymInt handle, int out_features) -> Tensor")
_lib.define("int4_linear(Tensor x, Tensor packed, int out_features) -> Tensor")
_lib.define("q8_linear(Tensor x, Tensor packed, int out_features) -> Tensor")


def _int8_linear_cpu(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """x (M, K + 2) float32, rows scaled into [-1, 1] -> (M, N) float32 (before the row scales)."""
    return torch.ops.quantized.linear_dynamic(x, _packed[handle], _REDUCE_RANGE)


@lru_cache(maxsize=1)
def _native_kernel() -> bool:
    """Register int8_linear's CPU kernel once: C++ where it builds (model/native_ops.py), else Python."""
    if native_ops.load():
        return True
    _lib.impl("int8_linear", _int8_linear_cpu, "CPU")
    _lib.impl("int4_linear", int4_linear_reference, "CPU")
    _lib.impl("q8_linear", q8_linear_reference, "CPU")
    return False


@torch.library.register_fake("attnserve::q8_linear", lib=_lib)
@torch.library.register_fake("attnserve::int4_linear", lib=_lib)
@torch.library.register_fake("attnserve::int8_linear", lib=_lib)
def _linear_fake(x: torch.Tensor, weights: int | torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


int8_linear = torch.ops.attnserve.int8_linear
int4_linear = torch.ops.attnserve.int4_linear
q8_linear = torch.ops.attnserve.q8_linear


# Without VNNI, fbgemm's u8 x s8 multiply-adds can saturate 16-bit sums; 7-bit activations avoid it.
_REDUCE_RANGE = not {"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags()


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, act_max: torch.Tensor | None = None, alpha: float = SMOOTH_ALPHA):
        """act_max (K,): max |input| per input channel seen in calibration; None = no smoothing."""
        super().__init__()
        w = linear.weight.detach().float()  # (N, K)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        smooth = torch.ones(w.shape[1])
        if act_max is not None:
            smooth = act_max.float().clamp(min=1e-5) ** alpha / w.abs().amax(dim=0).clamp(min=1e-5) ** (1 - alpha)
            w = w * smooth[None, :]
        self.register_buffer("inv_smooth", 1 / smooth)  # (K,)
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (N,)
        w = F.pad(w, (0, 2))  # (N, K + 2): zero weights for the two range-pinning columns
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized-tensor constructors warn of deprecation
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                            torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
        self.handle = next(_handles)
        if _native_kernel():  # the packed weights live in the table of the kernel that reads them
            torch.ops.attnserve_native.set_packed(self.handle, packed, _REDUCE_RANGE)
            weakref.finalize(self, torch.ops.attnserve_native.drop_packed, self.handle)
        else:
            _packed[self.handle] = packed
            weakref.finalize(self, _packed.pop, self.handle, None)
        # what a compiled step that calls the op by handle depends on (service/engine/aot_package.py)
        h = hashlib.blake2b(qw.int_repr().numpy().tobytes(), digest_size=8)
        h.update(scale.numpy().tobytes())
        self.fingerprint = f"{self.handle}:{h.hexdigest()}"
        self.register_buffer("handle_id", torch.tensor(self.handle), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.register_buffer("pins", torch.tensor([1.0, -1.0]), persistent=False)

    def _apply(self, fn, recurse=True):
        # `model.to(bfloat16)` must not round the smoothing factors: the weights were multiplied by the exact ones
        inv_smooth = self.inv_smooth
        super()._apply(fn, recurse)
        self.inv_smooth = inv_smooth.to(self.inv_smooth.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, self.in_features).float() * self.inv_smooth  # (M, K)
        # fbgemm takes one scale for the whole input: pinning its range to [-1, 1] gives each row its own
        row = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)  # (M, 1)
        xn = torch.cat([xf / row, self.pins.expand(xf.shape[0], 2)], dim=-1)  # (M, K + 2) in [-1, 1]
        handle = self.handle_id.item() if _handle_inputs else self.handle
        y = int8_linear(xn, handle, self.out_features) * row  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 per-row"


INT4_BLOCK = 16  # outputs per packed block


def pack_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """q (N, K) in 0..15, scale and low (N, K/32) -> uint8 (N/16, K/32, 320), the kernel's layout: per 16
    outputs and group, 4 x 64 bytes of nibbles (byte 4n + t of chunk i: input 4i + t of output n in the
    low nibble, input 16 + 4i + t in the high one: one mask and one shift unpack 64 bytes into two
    registers of 16 outputs x 4 inputs), then the 16 scales and 16 minima in fp16."""
    n, k = q.shape
    g = k // INT4_GROUP
    q5 = q.to(torch.uint8).view(n // INT4_BLOCK, INT4_BLOCK, g, 2, 4, 4)  # (nb, n, g, half, chunk, t)
    nib = (q5[:, :, :, 0] | (q5[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # (nb, g, chunk, n, t)

    def fp16(v: torch.Tensor) -> torch.Tensor:  # (N, G) -> (nb, G, 32) bytes
        return v.to(torch.float16).view(n // INT4_BLOCK, INT4_BLOCK, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nib.reshape(n // INT4_BLOCK, g, -1), fp16(scale), fp16(low)], dim=-1).contiguous()


def unpack_int4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_int4's inverse -> q (N, K) uint8, scale and low (N, K/32) float32."""
    nb, g, _ = packed.shape
    nib = packed[..., :256].view(nb, g, 4, INT4_BLOCK, 4)  # (nb, g, chunk, n, t)
    q = torch.stack([nib & 15, nib >> 4], dim=2)  # (nb, g, half, chunk, n, t)
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(nb * INT4_BLOCK, g * INT4_GROUP)

    def fp32(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(torch.float16).float().transpose(1, 2).reshape(nb * INT4_BLOCK, g)

    return q, fp32(packed[..., 256:288]), fp32(packed[..., 288:320])


def _group_dots(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) quantized as the C++ kernels do it, times integer weights q (N, K), group by group."""
    n, k = q.shape
    xg = x.float().view(-1, k // INT4_GROUP, INT4_GROUP)  # (M, G, 32)
    dx = xg.abs().amax(-1) / 127  # (M, G)
    xq = torch.round(xg * torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))[..., None]).clamp(-127, 127)  # (M, G, 32)
    dots = torch.einsum("mgk,ngk->mng", xq, q.float().view(n, k // INT4_GROUP, INT4_GROUP))  # exact integers
    return xq, dx, dots


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """What the C++ kernel computes, in torch ops (the kernel where it cannot be built, and its oracle): x
    quantized to int8 with one scale per row and group of 32, as the kernel quantizes its input."""
    q, scale, low = unpack_int4(packed)  # (N, K), (N, G), (N, G)
    xq, dx, dots = _group_dots(x, q)  # (M, G, 32), (M, G), (M, N, G)
    y = (dots * scale[None] * dx[:, None]).sum(-1) + (low[None] * (dx * xq.sum(-1))[:, None]).sum(-1)  # (M, N)
    return y.to(x.dtype)


Q8_BYTES = INT4_BLOCK * INT4_GROUP  # int8 weights per packed (block, group), then 16 fp16 scales


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (N, K) int8 in -127..127, scale (N, K/32) -> uint8 (N/16, K/32, 544), q8_linear's layout: per 16
    outputs and group, 16 chunks of 32 bytes (chunk 8h + j: outputs 8h..8h+7 x inputs 4j..4j+3 of the
    group, 4 bytes an output: one AVX2 register), then the 16 scales in fp16."""
    n, k = q.shape
    g = k // INT4_GROUP
    q6 = q.to(torch.int8).view(n // INT4_BLOCK, 2, 8, g, 8, 4)  # (nb, half, n, g, chunk, t)
    body = q6.permute(0, 3, 1, 4, 2, 5).reshape(n // INT4_BLOCK, g, Q8_BYTES).view(torch.uint8)
    scales = scale.to(torch.float16).view(n // INT4_BLOCK, INT4_BLOCK, g).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([body, scales], dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8's inverse -> q (N, K) int8, scale (N, K/32) float32."""
    nb, g, _ = packed.shape
    body = packed[..., :Q8_BYTES].contiguous().view(torch.int8).view(nb, g, 2, 8, 8, 4)  # (nb, g, half, chunk, n, t)
    q = body.permute(0, 2, 4, 1, 3, 5).reshape(nb * INT4_BLOCK, g * INT4_GROUP)
    scale = packed[..., Q8_BYTES:].contiguous().view(torch.float16).float().transpose(1, 2).reshape(nb * INT4_BLOCK, g)
    return q, scale


def q8_linear_reference(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """What q8_linear's C++ kernel computes, in torch ops (as `int4_linear_reference`)."""
    q, scale = unpack_q8(packed)  # (N, K), (N, G)
    xq, dx, dots = _group_dots(x, q)  # (M, G, 32), (M, G), (M, N, G)
    return (dots * scale[None] * dx[:, None]).sum(-1).to(x.dtype)  # (M, N)


class GroupLinear(nn.Module):
    """A linear over weights packed in groups of 32 along K for one of our C++ kernels (`kernel`), which
    quantizes the activations to int8 per row and group; subclasses pack the groups (`pack`)."""

    kernel: Callable
    kind: str

    def __init__(self, linear: nn.Linear):
        super().__init__()
        _native_kernel()
        self.out_features, self.in_features = n, k = linear.weight.shape
        wg = linear.weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)  # (N, K/g, g)
        self.register_buffer("packed", self.pack(wg))  # (N/16, K/32, bytes a block)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        n, k = linear.weight.shape
        return k % INT4_GROUP == 0 and n % INT4_BLOCK == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()  # what the C++ kernels read
        y = self.kernel(xk.reshape(-1, self.in_features), self.packed, self.out_features)  # (M, N)
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} group {INT4_GROUP}"


class Int4Linear(GroupLinear):
    """llama.cpp's Q4_1 groups (a dequantized GGUF's come back exactly: each holds q = 0 and q = 15)."""

    kernel, kind = int4_linear, "int4"

    @staticmethod
    def pack(wg: torch.Tensor) -> torch.Tensor:
        """wg (N, K/g, g) -> (N/16, K/32, 320)."""
        lo, hi = wg.amin(-1), wg.amax(-1)  # (N, K/g)
        scale = ((hi - lo) / 15).to(torch.float16).float().clamp(min=6e-8)  # fp16, as Q4_1 stores it
        lo = lo.to(torch.float16).float()
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)
        return pack_int4(q.flatten(1), scale, lo)


class Q8Linear(GroupLinear):
    """llama.cpp's Q8_0 groups: int8 weights with an fp16 scale (a dequantized GGUF's come back exactly)."""

    kernel, kind = q8_linear, "q8"

    @staticmethod
    def pack(wg: torch.Tensor) -> torch.Tensor:
        """wg (N, K/g, g) -> (N/16, K/32, 544)."""
        scale = (wg.abs().amax(-1) / 127).to(torch.float16).float().clamp(min=6e-8)  # (N, K/g), fp16 as Q8_0
        q = torch.round(wg / scale[..., None]).clamp(-127, 127)
        return pack_q8(q.flatten(1), scale)


def quantize_linears(model: nn.Module, mode: str, calibrate: Callable[[], object] | None = None,
                     keep: tuple[str, ...] = (), maxima: Path | None = None) -> int:
    """Replace `model`'s `nn.Linear` modules in place by their `mode` counterparts -> how many.

    `calibrate` runs the model to record int8's input maxima; `maxima` caches them in a file. Layers in
    `keep`, and shapes the int4 kernel cannot take, stay float. A tied output projection becomes a
    quantized copy; the embedding keeps its float weights."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs on CPU only; use 'none' on {next(model.parameters()).device}")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return 0  # nothing left to replace: no calibration run
    act_max = _input_maxima(model, calibrate, maxima) if mode == "int8" and calibrate is not None else {}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in keep and (mode == "int8" or Int4Linear.fits(child)):
                setattr(parent, name, Int8Linear(child, act_max.get(child)) if mode == "int8" else Int4Linear(child))
                swapped += 1
    return swapped


def _input_maxima(model: nn.Module, calibrate: Callable[[], object],
                  path: Path | None = None) -> dict[nn.Module, torch.Tensor]:
    """max |input| per input channel of every Linear that `calibrate` runs through -> {layer: (K,)}; kept in
    `path` by layer name, read back where each entry names one of this model's Linears with that width."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if path is not None and path.is_file():
        kept = {}
        with contextlib.suppress(SafetensorError, OSError):  # a torn or unreadable cache: calibrated again
            kept = load_file(str(path))
        if kept and all(n in linears and t.shape == (linears[n].in_features,) for n, t in kept.items()):
            return {linears[n]: t for n, t in kept.items()}
    seen: dict[nn.Module, torch.Tensor] = {}

    def record(layer, inputs, _output):
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()  # (K,)
        seen[layer] = torch.maximum(seen[layer], x) if layer in seen else x

    hooks = [m.register_forward_hook(record) for m in linears.values()]
    try:
        with torch.inference_mode():
            calibrate()
    finally:
        for h in hooks:
            h.remove()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({n: seen[m].contiguous() for n, m in linears.items() if m in seen}, str(tmp))
        os.replace(tmp, path)  # atomic: a replica starting beside this one reads all of it or nothing
    return seen


def prepacked_linear(linear: nn.Linear, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` as a compiled, frozen step runs it on CPU: oneDNN with the weight reordered once for about
    `rows` rows (inductor's freezing does this to the float linears it can pack); else the plain linear."""
    dtype = linear.weight.dtype
    packable = (torch.backends.mkldnn.is_available() and linear.weight.device.type == "cpu"
                and (torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16
                     else dtype == torch.float32 and torch._C.has_mkl))  # inductor's own conditions
    if not packable:
        return linear
    w = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
    b = linear.bias.detach() if linear.bias is not None else None
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def time_linears(mode: str, rows: int, dtype: torch.dtype = torch.float32, prepacked: bool = False) -> float:
    """Best-of-3 seconds of one pass through 30 x SmolLM2's MLP pair ((in, out) pairs) at `rows` rows in
    `mode` ('none': float in `dtype`, oneDNN-prepacked with `prepacked`). Many copies, so the weights do not
    fit the caches, as in a real decode step."""
    torch.manual_seed(0)
    layers = []
    shapes = ((576, 1536), (1536, 576)) * 30
    with torch.inference_mode():
        for k, n in shapes:
            lin = nn.Linear(k, n, bias=False)
            if mode == "none":
                lin = lin.to(dtype)
                layers.append(prepacked_linear(lin, rows) if prepacked else lin)
            else:
                layers.append(Int8Linear(lin) if mode == "int8" else Int4Linear(lin))
        xs = {k: torch.randn(rows, k, dtype=dtype) for k, _ in shapes}
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for (k, _), layer in zip(shapes, layers):
                layer(xs[k])
            best = min(best, time.perf_counter() - t)
    return best


AUTO_ROWS = (1, 16)  # one stream, and a busy batch


@lru_cache(maxsize=4)
def choose_quantization(dtype: torch.dtype = torch.float32, compiled: bool = False) -> str:
    """'auto': the fastest mode on this CPU over AUTO_ROWS rows, measured once per process (hosts differ);
    `compiled`: float linears prepacked, as the engine runs them. int8 only with VNNI (7-bit activations
    without it cost perplexity)."""
    modes = [m for m in QUANTIZATIONS if m != "int8" or not _REDUCE_RANGE]
    totals = {mode: sum(time_linears(mode, rows, dtype, prepacked=compiled) for rows in AUTO_ROWS) for mode in modes}
    return min(totals, key=totals.get)


def quantization_of(model: nn.Module) -> str:
    """The mode `quantize_decoder` left `model` in: int4 where any layer is int4 (or int4's Q8 head), else int8
    or none."""
    kinds = {type(m) for m in model.modules()}
    return "int4" if kinds & {Int4Linear, Q8Linear} else "int8" if Int8Linear in kinds else "none"


def int4_head() -> type[nn.Module]:
    """The output projection's layer under int4: 8 bits (SmolLM2's is Q8_0, which int4 would not hold).
    fbgemm's W8A8 where the CPU has VNNI; without it fbgemm takes 7-bit activations, so Q8 groups in our
    kernel, which also reads them faster there (docs/decisions.md, "Quantization")."""
    return Int8Linear if not _REDUCE_RANGE else Q8Linear


def quantize_decoder(model: nn.Module, tokenizer, mode: str, maxima: Path | None = None) -> int:
    """Quantize a decoder-only LM for serving -> layers replaced. int8: every linear, calibrated on
    CALIBRATION_TEXT. int4: the blocks' linears, and the output projection as `int4_head()`. `maxima`: the
    calibration's cache file (`quantize_linears`)."""
    if mode == "none":
        return 0
    ids = torch.tensor([tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))])  # (1, T)
    ids = ids[:, :model.cfg.max_seq_len]
    n = quantize_linears(model, "int4", keep=("lm_head",)) if mode == "int4" else 0
    if mode == "int4" and int4_head() is Q8Linear and Q8Linear.fits(model.lm_head):
        model.lm_head = Q8Linear(model.lm_head)
        n += 1
    return n + quantize_linears(model, "int8", calibrate=lambda: model(ids), maxima=maxima)
