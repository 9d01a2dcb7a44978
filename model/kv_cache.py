"""A KV cache built for batching across requests.

Buffers have a *slot* dimension, `k[layer]` (slots, kv_heads, max_len, head_dim); a request owns a slot, and
rows of one forward may use any slots at any positions, so sequences admitted at different times decode
together. Freeing a slot is O(1): a row only attends positions <= its own, which it has written itself.
Encoder-decoders also keep cross-attention K/V per slot.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 << 20


def cache_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros for a cache buffer; a large one on a Linux CPU gets its own mapping on transparent huge pages
    (a step reads short runs in hundreds of blocks: TLB misses), as touched heap memory keeps small pages.
    ATTNSERVE_HUGE_PAGES=0: off."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    if (torch.device(device).type != "cpu" or size < 4 * HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get("ATTNSERVE_HUGE_PAGES", "1") == "0"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private (a shared mapping is shmem: another THP setting) and untouched, as the advice applies at first
    # write; the kernel's zeros, as writing ours would fault in the whole cache at start-up
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # the tensor keeps `buf`


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, cross_len: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.n_slots, self.max_len, self.cross_len = n_slots, max_len, cross_len
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = cache_buffer(shape, dtype, device)  # (NL, S, Hkv, L, D)
        self.v = cache_buffer(shape, dtype, device)
        if cross_len:
            cshape = (n_layers, n_slots, n_kv_heads, cross_len, head_dim)
            self.cross_k = torch.zeros(cshape, dtype=dtype, device=device)  # (NL, S, Hkv, Ls, D)
            self.cross_v = torch.zeros(cshape, dtype=dtype, device=device)
            self.src_len = torch.zeros(n_slots, dtype=torch.long, device=device)  # (S,)

    def context(self, slots: torch.Tensor | list[int], positions: torch.Tensor) -> CacheContext:
        """Per-forward view: which slots the batch rows use and how far to read."""
        slots_t = torch.as_tensor(slots, dtype=torch.long, device=self.k.device)  # (B,)
        length = int(positions.max()) + 1
        if length > self.max_len:
            raise ValueError(f"position {length - 1} beyond cache max_len {self.max_len}")
        first = int(slots_t[0])
        contiguous = torch.equal(slots_t, torch.arange(first, first + len(slots_t), device=slots_t.device))
        sel = slice(first, first + len(slots_t)) if contiguous else slots_t
        src_length = int(self.src_len[slots_t].max()) if self.cross_len else 0
        return CacheContext(self, slots_t, sel, positions, length, src_length)

    def copy_slots(self, src: torch.Tensor | list[int], dst: torch.Tensor | list[int], *,
                   length: int | list[int] | None = None, cross: bool = True) -> None:
        """Copy whole slots src[i] -> dst[i] (beam search reorders hypotheses).

        `length`: only the first positions a hypothesis has written, one for all copies or one each;
        `cross=False` skips cross K/V, for beams of one source. Cross K/V are copied up to `src_len`.
        """
        src_l = [int(s) for s in src]
        dst_l = [int(d) for d in dst]
        if not src_l:
            return
        n = length if isinstance(length, list) else [self.max_len if length is None else length] * len(src_l)
        bufs = [(self.k, n), (self.v, n)]
        if self.cross_len and cross:
            m = self.src_len[src_l].tolist()
            self.src_len[dst_l] = self.src_len[src_l]  # the right side is gathered first
            bufs += [(self.cross_k, m), (self.cross_v, m)]
        if set(src_l) & set(dst_l):
            self._copy_gathered(bufs, src_l, dst_l)
        else:  # no slot is both read and written (every copy the engines make)
            self._copy_per_slot(bufs, src_l, dst_l)

    @staticmethod
    def _copy_per_slot(bufs: list[tuple[torch.Tensor, list[int]]], src: list[int], dst: list[int]) -> None:
        """One copy_ per slot, all layers in one view (faster than gathering). Disjoint src/dst only."""
        for buf, lengths in bufs:
            for s, d, k in zip(src, dst, lengths, strict=True):
                if k:
                    buf[:, d, :, :k].copy_(buf[:, s, :, :k])  # (NL, Hkv, k, D)

    def _copy_gathered(self, bufs: list[tuple[torch.Tensor, list[int]]], src: list[int], dst: list[int]) -> None:
        """Gather every source before writing, so overlapping src/dst are safe."""
        src_t = torch.tensor(src, dtype=torch.long, device=self.k.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        for buf, lengths in bufs:
            k = max(lengths)
            for i in range(buf.shape[0]):  # per layer: faster than one 5-d advanced index
                layer = buf[i, :, :, :k]  # (S, Hkv, k, D) view
                layer.index_copy_(0, dst_t, layer.index_select(0, src_t))

    def prefix_views(self, rows: int, length: int, src_length: int = 0):
        """Views of slots [0, rows) for the pure decode steps: k, v (NL, rows, Hkv, length, D), and for
        encoder-decoders cross_k, cross_v (NL, rows, Hkv, src_length, D), src_len (rows,)."""
        if rows > self.n_slots or length > self.max_len:
            raise ValueError(f"views of {rows} slots x {length} positions beyond the cache "
                             f"({self.n_slots} x {self.max_len})")
        views = (self.k[:, :rows, :, :length], self.v[:, :rows, :, :length])
        if not self.cross_len:
            return views
        if src_length > self.cross_len:
            raise ValueError(f"source length {src_length} beyond cache cross_len {self.cross_len}")
        return views + (self.cross_k[:, :rows, :, :src_length], self.cross_v[:, :rows, :, :src_length],
                        self.src_len[:rows])

    def write_step(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   rows: torch.Tensor | None = None) -> None:
        """Store one new key/value per row for every layer: k, v (NL, R, Hkv, D) go to slot r (rows are
        slots [0, R)) at positions[r] (R,); with `rows`, only those rows (their K/V, positions and slots)."""
        if rows is None:
            rows = torch.arange(k.shape[1], device=self.k.device)
        else:
            k, v, positions = k[:, rows], v[:, rows], positions[rows]
        # advanced indices in dims 1 and 3 -> the indexed shape is (R, NL, Hkv, D)
        self.k[:, rows, :, positions] = k.transpose(0, 1).to(self.k.dtype)
        self.v[:, rows, :, positions] = v.transpose(0, 1).to(self.v.dtype)

    def write_chunk(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt chunk's keys/values of every layer: k, v (NL, 1, Hkv, T, D) go to `slot` at
        positions start .. start + T - 1."""
        t = k.shape[3]
        self.k[:, slot, :, start:start + t] = k[:, 0].to(self.k.dtype)
        self.v[:, slot, :, start:start + t] = v[:, 0].to(self.v.dtype)

    def set_cross_all(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src_len: torch.Tensor) -> None:
        """Store cross-attention K/V of every layer: k, v (NL, B, Hkv, S, D) into `slots` (B,), whose
        sources are src_len (B,) tokens long."""
        s = k.shape[3]
        if s > self.cross_len:
            raise ValueError(f"source length {s} beyond cache cross_len {self.cross_len}")
        self.cross_k[:, slots, :, :s] = k.to(self.cross_k.dtype)
        self.cross_v[:, slots, :, :s] = v.to(self.cross_v.dtype)
        self.src_len[slots] = src_len.to(self.src_len.dtype)

    def free_slots(self, slots: torch.Tensor | list[int]) -> None:
        """O(1) release: self-attention data is masked by position; cross data by src_len."""
        if self.cross_len:
            self.src_len[torch.as_tensor(slots, dtype=torch.long, device=self.k.device)] = 0


@dataclass
class CacheContext:
    cache: KVCache
    slots: torch.Tensor  # (B,) slot of each batch row
    sel: slice | torch.Tensor  # slice when slots are contiguous (a view, no gather)
    positions: torch.Tensor  # (B, T) position of each new token
    length: int  # keys to read: max position + 1
    src_length: int  # cross-attention keys to read: max source length in the batch

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write new k, v (B, Hkv, T, D) at (slot, position); return (B, Hkv, length, D) to attend, and
        None: the new keys are among them (the `StepContext.update` contract)."""
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # (S, Hkv, L, D)
        rows = self.slots[:, None]  # (B, 1) broadcast against positions (B, T)
        # advanced indices in dims 0 and 2 -> indexed shape is (B, T, Hkv, D)
        ck[rows, :, self.positions] = k.transpose(1, 2).to(ck.dtype)  # the cache may keep a wider dtype
        cv[rows, :, self.positions] = v.transpose(1, 2).to(cv.dtype)
        return self._read(ck, self.length), self._read(cv, self.length), None

    def _read(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """buf (S, Hkv, L, D) -> these rows' slots, first n positions: (B, Hkv, n, D); a view when the slots
        are contiguous, else index_select (faster than advanced indexing on CPU)."""
        return buf[self.sel, :, :n] if isinstance(self.sel, slice) else buf[:, :, :n].index_select(0, self.sel)

    def cross(self, layer: int):
        """Cross-attention k, v (B, Hkv, src_length, D); `cross_mask` says which keys are real."""
        n = self.src_length
        return self._read(self.cache.cross_k[layer], n), self._read(self.cache.cross_v[layer], n)

    def cross_mask(self) -> torch.Tensor:
        lens = self.cache.src_len[self.slots]  # (B,)
        ar = torch.arange(self.src_length, device=lens.device)
        return (ar[None, :] < lens[:, None])[:, None, None, :]  # (B, 1, 1, Ls)

    def self_mask(self) -> torch.Tensor:
        """Row t of batch b may attend key j iff j <= positions[b, t]: (B, 1, T, length)."""
        ar = torch.arange(self.length, device=self.positions.device)
        return (ar[None, None, :] <= self.positions[:, :, None])[:, None]


class StepContext:
    """One decode step (one new token per row) over prefix *views* of the cache, without writing it.

    Stands in for a `CacheContext` in the pure step functions, so eager and compiled decoding share the
    module code; nothing here depends on tensor values, slot lists or in-place writes, which would break or
    specialise a compiled graph. Row r attends the first positions[r] keys of the views and its own new
    key, which `update` collects in `new_k`, `new_v` for the caller to store (`KVCache.write_step`).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 cross_k: torch.Tensor | None = None, cross_v: torch.Tensor | None = None,
                 src_len: torch.Tensor | None = None):
        self.k, self.v = k, v  # (NL, R, Hkv, L, D) cached prefixes
        self.positions = positions  # (R,)
        self.cross_k, self.cross_v = cross_k, cross_v  # (NL, R, Hkv, S, D); row r uses src_len[r] (R,)
        self.src_len = src_len
        self.new_k: list[torch.Tensor] = []  # per layer (R, Hkv, D), in the cache's dtype
        self.new_v: list[torch.Tensor] = []

    def self_mask(self) -> torch.Tensor:
        """The cached keys row r may attend, those before its position: (R, 1, 1, L). Its own key is
        always attended (`prefix_attention`)."""
        keys = torch.arange(self.k.shape[3], device=self.positions.device)
        return (keys[None, :] < self.positions[:, None])[:, None, None, :]

    def cross_mask(self) -> torch.Tensor:
        src = torch.arange(self.cross_k.shape[3], device=self.src_len.device)
        return (src[None, :] < self.src_len[:, None])[:, None, None, :]  # (R, 1, 1, S)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """New k, v (R, Hkv, 1, D) -> the layer's cached prefix views (R, Hkv, L, D) and the new k, v
        apart (in the cache's dtype, as a stored key would be), to attend over both."""
        if k.shape[2] != 1:
            raise ValueError(f"a step context takes one new token per row, not {k.shape[2]}")
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        self.new_k.append(k[:, :, 0])
        self.new_v.append(v[:, :, 0])
        return self.k[layer], self.v[layer], (k, v)

    def cross(self, layer: int):
        """Cross-attention k, v (R, Hkv, S, D); `cross_mask` says which keys are real."""
        return self.cross_k[layer], self.cross_v[layer]

    def stacked_new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's new k, v: (NL, R, Hkv, D) x 2 for `KVCache.write_step`; a chunk's (NL, 1, Hkv, T, D)
        x 2 for `KVCache.write_chunk`."""
        return torch.stack(self.new_k), torch.stack(self.new_v)


class ChunkContext(StepContext):
    """`StepContext` for a compiled prefill: a prompt chunk of T new tokens over its slot's prefix views.
    Token t attends the first `positions[0, 0]` cached keys and new tokens 0..t; the new keys are collected
    for `KVCache.write_chunk`. k, v (NL, 1, Hkv, L, D); positions (1, T), consecutive."""

    def self_mask(self) -> torch.Tensor:
        """(1, 1, T, L + T): the cached keys before the chunk, then the chunk's own keys causally."""
        t = self.positions.shape[1]
        keys = torch.arange(self.k.shape[3], device=self.positions.device)
        cached = (keys < self.positions[0, 0]).expand(t, -1)  # (T, L)
        own = torch.ones(t, t, dtype=torch.bool, device=self.positions.device).tril()  # (T, T)
        return torch.cat([cached, own], dim=1)[None, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """New k, v (1, Hkv, T, D) -> prefix and new keys/values joined (1, Hkv, L + T, D), and None: the new
        keys are among them (the `StepContext.update` contract)."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        self.new_k.append(k)
        self.new_v.append(v)
        return torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2), None
