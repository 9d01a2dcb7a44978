"""Compiled per-step work of the engines (`EngineConfig.compile`): AOTInductor packages kept under
`$ATTNSERVE_HOME` (service/engine/aot_package.py); where one cannot be built, the engine runs eagerly.

An eager decode step pays per-op overhead and unfused elementwise passes; inductor fuses them into C++ and,
with `freezing`, prepacks float linears for oneDNN. The compiled functions are the pure steps of
model/seq2seq_step.py and model/decoder_step.py; other prompt prefill stays eager. Every size is dynamic, so
one graph per function serves every batch. All of it happens in `warm_up`, before requests.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch
from torch.export import Dim

from model.cpu_features import cpu_flags
from model.decoder import DecoderLM
from model.decoder_step import blocks_step, chunk_blocks_step, decoder_step, head_step
from model.kv_cache import KVCache
from model.paths import home
from model.seq2seq import EncoderDecoder
from model.seq2seq_step import decode_step, encode_cross
from service.engine.aot_package import fingerprint, load_or_build, load_or_build_each, package_path, weights

log = logging.getLogger(__name__)


def use_persistent_cache() -> Path:
    """Point inductor's caches at `$ATTNSERVE_HOME/compile/<torch version>-<CPU flags and GPUs hash>` (unless the
    user set TORCHINDUCTOR_CACHE_DIR), so a restart loads the generated code instead of compiling it again;
    the hash keeps hosts apart where ATTNSERVE_HOME is shared."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment on first use: only a different value is the user's
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        host = " ".join(sorted(cpu_flags()))
        if torch.cuda.is_available():  # GPU kernels are built for the device's architecture
            host += "".join(f" {torch.cuda.get_device_name(i)}:{torch.cuda.get_device_capability(i)}"
                            for i in range(torch.cuda.device_count()))
        flags = hashlib.sha256(host.encode()).hexdigest()[:12]
        d = home() / "compile" / f"torch-{torch.__version__}-{flags}"
        d.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])

MIN_SIZE = 2  # torch.export specialises example sizes 0 and 1
# cross-attention reads source keys 1.. as a prefix (model/attention.py): that prefix too stays >= MIN_SIZE
MIN_SRC = MIN_SIZE + 1


def cache_slots(max_slots: int, compile: bool) -> int:
    """Slots an engine's cache holds: a compiled one gets spares up to MIN_SIZE + 1 (never handed out), so an
    engine of one or two slots compiles too."""
    return max(max_slots, MIN_SIZE + 1) if compile else max_slots


# The cached prefix a decode step reads is rounded up to a multiple of this (the extra keys masked): oneDNN
# builds a matmul primitive per shape, and a length growing by one would miss its cache every step.
LENGTH_STEP = 64


def prefix_length(positions: list[int], limit: int) -> int:
    """How many cached positions a decode step at `positions` reads: their maximum rounded up."""
    return min(max(-(-max(positions) // LENGTH_STEP) * LENGTH_STEP, MIN_SIZE), limit)


def _hint_sizes(*wanted: tuple[int, int]) -> list[int]:
    """Example sizes to export at, close to serving's (inductor tunes the code for them), in [MIN_SIZE, limit]
    and pairwise distinct (torch.export would take equal sizes for one dimension). Callers keep limits below
    the cache's: a view spanning a whole dimension has its strides traced as functions of the sizes, and the
    package then reads every shorter view wrongly."""
    out: list[int] = []
    for want, limit in wanted:
        n = max(MIN_SIZE, min(want, limit))
        while n in out and n > MIN_SIZE:
            n -= 1
        while n in out:
            n += 1
        out.append(n)
    return out


class CompiledTranslator:
    """Compiled encoder admission and decoder step over a translator's slot cache."""

    def __init__(self, model: EncoderDecoder, cache: KVCache, key: tuple | None = None):
        """`key`: the packages' key where the caller already has it (`self.key`): it hashes every weight."""
        # example sizes stay below the cache's (`_hint_sizes`), and at least MIN_SIZE
        if min(cache.n_slots, cache.max_len) <= MIN_SIZE or cache.cross_len <= MIN_SRC:
            raise ValueError(f"compiled steps need > {MIN_SIZE} slots and positions, > {MIN_SRC} source positions")
        self.model, self.cache = model, cache
        self.where = use_persistent_cache()
        self.pad_id = model.cfg.pad_id
        self.dev = cache.k.device
        self.key = key if key is not None else (type(model).__name__, repr(model.cfg), fingerprint(model),
                                                cache.n_slots, cache.max_len, cache.cross_len, str(cache.k.dtype),
                                                str(self.dev))
        self._decode = self._encode = None  # the packages' run functions, set by warm_up
        self.compile_seconds: float | None = None

    def warm_up(self) -> None:
        """Load or build the decode step's and the encoder's packages (raises where they cannot be built)."""
        t0 = time.perf_counter()
        c = self.cache
        rows, length, src = _hint_sizes((15, c.n_slots - 1), (47, c.max_len - 1), (41, c.cross_len - 1))
        # the encoder's package is exported apart: its source count is distinct from its width only, <= n_slots
        n_src = _hint_sizes((src, src), (3, c.n_slots))[1]
        tokens = torch.full((rows,), self.pad_id, dtype=torch.long, device=self.dev)
        positions = torch.zeros(rows, dtype=torch.long, device=self.dev)
        k, v, ck, cv, src_len = self.cache.prefix_views(rows, length, src)
        sources = torch.full((n_src, src), self.pad_id, dtype=torch.long, device=self.dev)
        sources[:, 0] = self.model.cfg.eos_id
        # lengths below the cache's (`_hint_sizes`): positions < max_len, and the runner keeps a spare source position
        r, n = Dim("rows", min=1, max=c.n_slots), Dim("length", min=MIN_SIZE, max=c.max_len - 1)
        s = Dim("src", min=MIN_SRC, max=c.cross_len - 1)
        srcs, width = Dim("sources", min=1, max=c.n_slots), Dim("width", min=MIN_SIZE, max=self.model.cfg.max_src_len)
        decode_name, encode_name = self.PACKAGES
        self._decode, self._encode = load_or_build_each(
            functools.partial(load_or_build, self.where, decode_name, decode_step, self.model,
                              (tokens, positions, k, v, ck, cv, src_len.clamp(min=1)),
                              ({0: r}, {0: r}, {1: r, 3: n}, {1: r, 3: n}, {1: r, 3: s}, {1: r, 3: s}, {0: r}),
                              freezing=True, key=self.key),
            functools.partial(load_or_build, self.where, encode_name, encode_cross, self.model,
                              (sources, sources != self.pad_id), ({0: srcs, 1: width}, {0: srcs, 1: width}),
                              freezing=True, key=self.key))
        self.compile_seconds = time.perf_counter() - t0
        log.info("translator's encoder and decode step ready in %.1f s", self.compile_seconds)

    PACKAGES = ("translator-decode", "translator-encode")

    def built(self, threads: int) -> bool:
        """Whether this host has the packages of these steps for `threads` torch threads (`warm_up` would
        load them, not build them)."""
        return all(package_path(self.where, name, self.key, freezing=True, threads=threads).is_file()
                   for name in self.PACKAGES)

    def encode(self, sources: list[list[int]], copies: list[int], slots: list[int]) -> None:
        """Source i's cross K/V into the next copies[i] of `slots` (a beam's hypotheses share their source)."""
        width = max(max(len(s) for s in sources), MIN_SIZE)  # masked positions pad the width
        src = torch.tensor([s + [self.pad_id] * (width - len(s)) for s in sources], device=self.dev)  # (N, S)
        lengths = torch.tensor([len(s) for s in sources], device=self.dev)  # (N,)
        mask = torch.arange(width, device=self.dev)[None, :] < lengths[:, None]  # (N, S)
        ck, cv = self._encode(src, mask)  # (NL, N, H, S, D) x 2
        rep = torch.tensor([i for i, c in enumerate(copies) for _ in range(c)], device=self.dev)
        self.cache.set_cross_all(torch.tensor(slots, device=self.dev), ck[:, rep], cv[:, rep], lengths[rep])

    def decode(self, tokens: list[int], positions: list[int], src_lengths: list[int]) -> torch.Tensor:
        """tokens, positions, source lengths of rows [0, R) -> logits (R, V); writes their K/V."""
        length = prefix_length(positions, self.cache.max_len - 1)
        src = min(max(max(src_lengths), MIN_SRC), self.cache.cross_len)
        tokens_t = torch.tensor(tokens, device=self.dev)  # (R,)
        positions_t = torch.tensor(positions, device=self.dev)  # (R,)
        k, v, ck, cv, src_len = self.cache.prefix_views(len(tokens), length, src)
        logits, new_k, new_v = self._decode(tokens_t, positions_t, k, v, ck, cv, src_len.clamp(min=1))
        self.cache.write_step(new_k, new_v, positions_t)
        return logits  # (R, V)


SHARED_LAYERS = 3  # at most this many layers per shared package call (the rest of the layers reuse it)


class _Head(torch.nn.Module):
    """The decoder's final norm and output projection: the template of its shared head package."""

    head = DecoderLM.head

    def __init__(self, model: DecoderLM):
        super().__init__()
        self.norm, self.lm_head = model.norm, model.lm_head


def _through_runs(blocks, run_weights, x, positions, k, v, rope: tuple):
    """x through every run of layers (the shared `blocks` package called with each run's weights) over its
    cached prefix k, v -> x, and every layer's new K/V: (NL, rows, Hkv, [T,] D) x 2."""
    new_k, new_v = [], []
    for lo, hi, w in run_weights:
        x, nk, nv = blocks(x, positions, k[lo:hi], v[lo:hi], *rope, *w)  # nk, nv (G, rows, Hkv, [T,] D)
        new_k.append(nk)
        new_v.append(nv)
    return x, torch.cat(new_k), torch.cat(new_v)


class CompiledDecoder:
    """Compiled decode step of a decoder-only LM over its slot cache. The rows are slots [0, n); slots
    that do not decode this step (a prompt still prefilling) run as pad rows whose K/V are not stored.

    Float linears: one whole-step package, weights frozen in. A quantized model gains nothing from freezing,
    so its step is shared packages, one for a run of `SHARED_LAYERS` layers (called with each run's weights)
    and one for the head: build time grows with the graph (docs/decisions.md)."""

    def __init__(self, model: DecoderLM, cache: KVCache):
        if min(cache.n_slots, cache.max_len) <= MIN_SIZE:  # as CompiledTranslator's
            raise ValueError(f"a compiled decode step needs > {MIN_SIZE} slots and positions")
        self.model, self.cache = model, cache
        self.where = use_persistent_cache()
        self.dev = cache.k.device
        self._decode = None  # the package's run function, set by warm_up
        self.compile_seconds: float | None = None
        self._chunk: tuple | None = None  # the compiled prefill's blocks package and runs of layers, once loaded
        self._chunk_spec: tuple | None = None  # what loading or building it takes (quantized models)

    @property
    def prefill_pending(self) -> bool:
        """Whether this step has a compiled prefill that is neither built nor loaded yet."""
        return self._chunk_spec is not None and self._chunk is None

    def warm_up(self, build_prefill: bool = True) -> None:
        """Load or build the decode step's packages (raises where they cannot be built). A quantized model's
        prompt prefill gets a package too; without `build_prefill` it is left to `load_prefill` (a replica's first
        start builds it in a child once ready)."""
        t0 = time.perf_counter()
        self.threads = torch.get_num_threads()
        c = self.cache
        rows, length = _hint_sizes((31, c.n_slots - 1), (300, c.max_len - 1))
        tokens = torch.zeros(rows, dtype=torch.long, device=self.dev)
        positions = torch.zeros(rows, dtype=torch.long, device=self.dev)
        k, v = c.prefix_views(rows, length)
        # lengths below the cache's: a view spanning a whole dimension has other strides (positions < max_len)
        r, n = Dim("rows", min=1, max=c.n_slots), Dim("length", min=MIN_SIZE, max=c.max_len - 1)
        shape = (type(self.model).__name__, repr(self.model.cfg), c.n_slots, c.max_len, str(c.k.dtype), str(self.dev))
        if any(isinstance(m, torch.nn.Linear) for m in self.model.modules()):  # a float linear is left to freeze
            self._decode = load_or_build(self.where, "decoder-decode", decoder_step, self.model,
                                         (tokens, positions, k, v), ({0: r}, {0: r}, {1: r, 3: n}, {1: r, 3: n}),
                                         freezing=True, key=(*shape, fingerprint(self.model)))
        else:
            self._decode = self._shared_step(tokens, positions, k, v, r, n, shape)
        try:
            self.load_prefill(build=build_prefill)
        except Exception:  # prompts then prefill eagerly: slower to a first token, not wrong
            log.warning("decoder: compiled prefill failed; prefilling eagerly", exc_info=True)
            self._chunk_spec = None
        self.compile_seconds = time.perf_counter() - t0
        log.info("decoder's decode step ready in %.1f s", self.compile_seconds)

    def _shared_step(self, tokens, positions, k, v, r: Dim, n: Dim, shape: tuple):
        """The step of a quantized model from a shared package for runs of layers and one for the head."""
        m, layers = self.model, len(self.model.blocks)
        g = max(d for d in range(1, min(SHARED_LAYERS, layers) + 1) if layers % d == 0)
        runs = [torch.nn.ModuleList(m.blocks[i:i + g]) for i in range(0, layers, g)]
        with torch.no_grad():
            x, rope = m.embed_tokens(tokens[:, None], positions[:, None])  # (R, 1, d)
        rope = tuple(rope or ())  # (cos, sin) (R, 1, 1, D), or none
        kv = {1: r, 3: n}
        head_module = _Head(m)
        blocks, head = load_or_build_each(
            functools.partial(load_or_build, self.where, "decoder-blocks", blocks_step, runs[0],
                              (x, positions, k[:g], v[:g], *rope), ({0: r}, {0: r}, kv, kv, *[{0: r}] * len(rope)),
                              freezing=False, key=(*shape, repr(runs[0])), shared=True),
            functools.partial(load_or_build, self.where, "decoder-head", head_step, head_module, (x[:, 0],), ({0: r},),
                              freezing=False, key=(*shape, repr(head_module)), shared=True))
        run_weights = [(i, i + g, weights(run)) for i, run in zip(range(0, layers, g), runs, strict=True)]
        head_weights = weights(head_module)
        self._chunk_spec = (runs[0], run_weights, shape, lambda x: head(x, *head_weights)[0])

        def step(tokens, positions, k, v):  # (R,), (R,), (NL, R, Hkv, L, D) x 2
            x, rope = m.embed_tokens(tokens[:, None], positions[:, None])  # (R, 1, d)
            x, new_k, new_v = _through_runs(blocks, run_weights, x, positions, k, v, rope or ())
            (logits,) = head(x[:, 0], *head_weights)  # (R, V)
            return logits, new_k, new_v

        return step

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Rows in `slots` (ascending) take `tokens` at `positions` -> logits (len(slots), V); their K/V
        are written. Other slots below the largest are pad rows (token 0 at position 0, not stored)."""
        n = slots[-1] + 1
        all_tokens, all_positions = [0] * n, [0] * n
        for slot, tok, pos in zip(slots, tokens, positions, strict=True):
            all_tokens[slot], all_positions[slot] = tok, pos
        length = prefix_length(positions, self.cache.max_len - 1)
        tokens_t = torch.tensor(all_tokens, device=self.dev)  # (n,)
        positions_t = torch.tensor(all_positions, device=self.dev)  # (n,)
        k, v = self.cache.prefix_views(n, length)
        logits, new_k, new_v = self._decode(tokens_t, positions_t, k, v)
        rows = None if len(slots) == n else torch.tensor(slots, device=self.dev)
        self.cache.write_step(new_k, new_v, positions_t, rows=rows)
        return logits if rows is None else logits[rows]  # (len(slots), V)

    def load_prefill(self, build: bool = False) -> bool:
        """Load the compiled prefill of one slot's prompt chunk (the shared blocks package at T new tokens),
        building it first with `build` -> whether it is in use. It saves the eager forward's per-op cost,
        which dominates a short prompt."""
        if self._chunk_spec is None:
            return False
        if self._chunk is not None:
            return True
        template, run_weights, shape, head = self._chunk_spec
        m, c = self.model, self.cache
        t, length = _hint_sizes((13, c.max_len - 1), (64, c.max_len - 1))
        positions = torch.arange(t, device=self.dev)[None]  # (1, T)
        with torch.no_grad():
            x, rope = m.embed_tokens(torch.zeros_like(positions), positions)  # (1, T, d)
        rope = tuple(rope or ())  # (cos, sin) (1, 1, T, D), or none
        g = run_weights[0][1]
        k, v = c.k[:g, :1, :, :length], c.v[:g, :1, :, :length]  # (G, 1, Hkv, L, D)
        chunk, n = Dim("chunk", min=MIN_SIZE, max=c.max_len - 1), Dim("length", min=MIN_SIZE, max=c.max_len - 1)
        blocks = load_or_build(self.where, "decoder-prefill", chunk_blocks_step, template,
                               (x, positions, k, v, *rope), ({1: chunk}, {1: chunk}, {3: n}, {3: n},
                                                            *[{2: chunk}] * len(rope)),
                               freezing=False, key=(*shape, repr(template)), shared=True, threads=self.threads,
                               build=build)
        if blocks is not None:
            self._chunk = (blocks, run_weights, head)
        return blocks is not None

    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor | None:
        """A prompt chunk of `slot` at positions start.. through the compiled prefill -> its last position's
        logits (V,), its K/V written; None where there is none (not loaded, or past the cache's end)."""
        if self._chunk is None:
            return None
        blocks, run_weights, head = self._chunk
        n = len(tokens)
        width = max(n, MIN_SIZE)  # a lone token takes a pad token after it: causal, it changes nothing
        if start + width > self.cache.max_len - 1:
            return None
        positions = torch.arange(start, start + width, device=self.dev)[None]  # (1, W)
        ids = torch.tensor([tokens + [0] * (width - n)], device=self.dev)  # (1, W)
        x, rope = self.model.embed_tokens(ids, positions)  # (1, W, d)
        length = prefix_length([start], self.cache.max_len - 1)
        k, v = self.cache.k[:, slot:slot + 1, :, :length], self.cache.v[:, slot:slot + 1, :, :length]
        x, new_k, new_v = _through_runs(blocks, run_weights, x, positions, k, v, rope or ())
        self.cache.write_chunk(slot, start, new_k[..., :n, :], new_v[..., :n, :])
        return head(x[:, n - 1])[0]  # (V,)
