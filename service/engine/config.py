"""Engine configuration: one dataclass, loadable from a dict (unknown keys rejected)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from model.strict_fields import FromDict, check_choices

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig(FromDict):
    max_slots: int = 16  # KV cache slots = max concurrent sequences (beam hypotheses count one each)
    max_seq_len: int = 2048  # per-slot cache length (prompt + output), <= the model's max
    max_waiting: int = 256  # groups waiting beyond the free slots at which new requests get EngineOverloaded (429)
    prefill_chunk: int = 256  # prompt tokens per request per step (long prompts prefill in chunks)
    mode: Literal["continuous", "static", "serial"] = "continuous"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # KV cache dtype; "auto" = the weights' dtype (float32 under bf16 weights doubles the cache for no gain:
    # docs/decisions.md)
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int | None = None  # torch threads of the engine thread; None = torch default (the cores it sees)
    # torch threads for a step that only prefills prompts (nothing decoding) while the host's other engines
    # are idle (service/engine/cpu_runtime.py); None = `threads`
    prefill_threads: int | None = None
    # torch threads for a step that decodes, on the same terms: one stream's tokens come faster while the
    # host's other engines are idle; None = `threads`
    decode_threads: int | None = None
    # a prompt copies the K/V of the longest prefix already cached (a running sequence's tokens or a freed
    # slot's) instead of prefilling it (service/engine/prefix_reuse.py); the generation engine only
    prefix_reuse: bool = True
    default_deadline_s: float | None = None  # per-request time limit when the request has none
    static_batch_wait_s: float = 0.01  # static mode: wait this long for a batch to fill
    prefill_budget: int = 512  # prompt tokens per step across all requests (bounds a step's latency)
    # a step's prompts go in right-padded forwards whose pad positions stay within this share of their
    # real tokens (length-sorted groups); a huge value = one padded forward for all of them
    prefill_max_padding: float = 0.25
    # compile the steps before serving (service/engine/compiled.py): time at start, once per host, for faster
    # CPU steps; falls back to eager, with a warning, if it fails
    compile: bool = False

    def __post_init__(self):
        check_choices(self)
        for name, least in (("max_slots", 1), ("max_seq_len", 1), ("prefill_chunk", 1), ("prefill_budget", 1),
                            ("prefill_max_padding", 0), ("max_waiting", 0)):
            if not getattr(self, name) >= least:  # NaN too
                raise ValueError(f"EngineConfig.{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 <= (wait := self.static_batch_wait_s) < math.inf:  # the loop sleeps it out whole: inf never wakes
            raise ValueError(f"EngineConfig.static_batch_wait_s must be >= 0 and finite, got {wait}")
        if self.default_deadline_s is not None and not self.default_deadline_s > 0:  # NaN too
            raise ValueError(f"EngineConfig.default_deadline_s must be > 0 or None, got {self.default_deadline_s}")
        for name in ("threads", "prefill_threads", "decode_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1 or None, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_dtype == "auto" else DTYPES[self.kv_dtype]
