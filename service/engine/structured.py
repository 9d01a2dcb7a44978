"""Structured output: a JSON schema as a token mask for the rows that ask (llguidance, chosen by
measurement: docs/performance.md). Its vocabulary is our tokenizer's own bytes, never a hub download.

`compile` (any thread) turns a schema into a template matcher, cached by the schema's text; each choice gets
its own copy. On the worker thread a step fills its constrained rows' bitmasks in one parallel call and
masks only those rows' logits.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import torch

from model.tokenizer import encode_rendered
from service.engine.types import RequestRejected

# compact JSON: no free whitespace, so a small model cannot loop on blanks, and no tokens spent on it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CACHE_SIZE = 128  # compiled schemas kept
NEG_INF_BITS = -8388608  # 0xFF800000, float32 -inf, as an int32


# keys whose value is one schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12, draft 7)
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "not",
        "if", "then", "else", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ALTERNATIVES = ("anyOf", "oneOf")  # beside listed properties: the same object, with more of them


def _pointer(key: str, name: str) -> str:
    """The `$ref` that names definition `name` of the root's `key` (JSON Pointer escapes `~` and `/`)."""
    return f"#/{key}/" + name.replace("~", "~0").replace("/", "~1")


def _combined_refs(root) -> set[str]:
    """The `$ref`s whose targets describe the same object as other schemas: members of an `allOf`, of an
    `anyOf` or `oneOf` beside listed properties or inside a schema so combined, and a `$ref` beside or inside
    either; a definition so named is combined itself, so its own `$ref`s are followed (an alias, a union of
    bases). More found only leaves more open."""
    refs: set[str] = set()
    targets = {_pointer(k, name): s for k in ("$defs", "definitions") if isinstance(root, dict)
               and isinstance(root.get(k), dict) for name, s in root[k].items()}

    def walk(schema, combined: bool) -> None:
        if isinstance(schema, list):
            for v in schema:
                walk(v, False)
        if not isinstance(schema, dict):
            return
        listed = isinstance(schema.get("properties"), dict)
        for k, v in schema.items():
            if k == "allOf" and isinstance(v, list):
                for m in v:
                    walk(m, True)
            elif k in _ALTERNATIVES and isinstance(v, list):
                for m in v:
                    walk(m, combined or listed)
            else:
                walk(v, False)
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref not in refs and (combined or listed or "allOf" in schema):
            refs.add(ref)
            walk(targets.get(ref), True)

    walk(root, False)
    return refs


def closed_objects(schema, combined: bool = False, refs: set[str] | None = None):
    """A copy of `schema` where an object that lists `properties` but says nothing of others allows no
    others, as xgrammar, outlines and OpenAI's strict mode read it: left open, a small model invents keys
    (`{"a": 1, "": 2}`). An explicit `additionalProperties` stays. Members of `allOf`, and of an `anyOf` or
    `oneOf` beside listed properties, stay open (`combined`): each describes the same object as the others or
    its parent, so closing one would forbid their properties; such a parent allows its alternatives'
    properties too (their own schemas still apply). So do definitions a `$ref` in such a place names, and an
    object beside a `$ref` (`refs`: those `$ref`s, found at the root)."""
    if not isinstance(schema, dict):
        return schema
    refs = _combined_refs(schema) if refs is None else refs
    out = dict(schema)
    listed = isinstance(out.get("properties"), dict)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = closed_objects(out[k], refs=refs)
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(s, combined=(listed or combined) and k in _ALTERNATIVES, refs=refs)
                      for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(s, combined=_pointer(k, name) in refs, refs=refs)
                      for name, s in out[k].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, combined=True, refs=refs) for s in out["allOf"]]
    if (listed and not combined and "allOf" not in out and "$ref" not in out
            and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()):
        alternatives = [s for k in _ALTERNATIVES if isinstance(out.get(k), list) for s in out[k]]
        names = [n for s in alternatives if isinstance(s, dict) and isinstance(s.get("properties"), dict)
                 for n in s["properties"]]
        out["properties"] = {**out["properties"], **{n: {} for n in names if n not in out["properties"]}}
        out["additionalProperties"] = False
    return out


class GrammarError(Exception):
    """A sampled token the grammar refused (its mask allowed no token at all): the row cannot go on."""


class Grammars:
    """Compiled JSON-schema grammars over one tokenizer's vocabulary, and their per-step masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._lock = threading.Lock()
        self._ll = None  # (llguidance module, LLTokenizer, LLExecutor), built on first use
        # templates by schema text, the least recently used dropped; a schema that fails is not kept
        self._template = functools.lru_cache(maxsize=CACHE_SIZE)(self._build)
        self._words = (vocab_size + 31) // 32  # int32 words per row of a bitmask

    def _setup(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                tok, eos = self.tokenizer, self.stop_ids[0]
                if not hasattr(tok, "token_bytes"):
                    raise RequestRejected(f"structured output needs the tokenizer's vocabulary as bytes; "
                                          f"{type(tok).__name__} does not provide token_bytes()")
                tokens = tok.token_bytes()[: self.vocab_size]
                tokens += [b""] * (self.vocab_size - len(tokens))  # ids the tokenizer lacks: never allowed
                specials = sorted(set(getattr(tok, "special_ids", ())) | set(self.stop_ids))

                class Vocabulary:  # the attributes llguidance.TokenizerWrapper reads
                    eos_token_id, bos_token_id = eos, None
                    special_token_ids = specials

                    def __call__(self, s: bytes) -> list[int]:
                        # no BOS added: else the mask asks for BOS first
                        return encode_rendered(tok, s.decode("utf-8", "ignore"))

                Vocabulary.tokens = tokens
                lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=self.vocab_size,
                                               eos_token=self.stop_ids)
                self._ll = (llguidance, lltok, llguidance.LLExecutor())
        return self._ll

    def compile(self, schema: dict):
        """A fresh matcher for `schema` (cached: copies are cheap), or RequestRejected naming the problem."""
        if not self.stop_ids:
            raise RequestRejected("structured output needs an end-of-sequence token; this model has none")
        if "x-guidance" in schema:  # the grammar library's options: "lenient" skips keywords it cannot enforce
            raise RequestRejected("invalid JSON schema: x-guidance is not accepted; the service sets the grammar's "
                                  "options (compact JSON, every keyword enforced or the schema refused)")
        # cached by the schema's JSON text, keys in the client's order (the grammar writes an object's properties
        # in that order, so schemas that differ only in it are different grammars)
        return self._template(json.dumps(schema, separators=(",", ":"), ensure_ascii=False)).deep_copy()

    def _build(self, key: str):
        """The template matcher of the schema whose JSON text (as `compile` writes it) is `key`."""
        ll, lltok, _ = self._setup()
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(closed_objects(json.loads(key)), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise RequestRejected(f"invalid JSON schema: {e}") from None
        template = ll.LLMatcher(lltok, grammar, log_level=0)  # builds the lexer: the costly part
        if template.is_error():
            raise RequestRejected(f"JSON schema not supported: {template.get_error()}")
        return template

    def fill(self, matchers: list) -> torch.Tensor:
        """The next-token bitmask of each matcher: (R, ceil(V / 32)) int32, bit set = allowed."""
        _, _, executor = self._ll
        bitmask = torch.empty(len(matchers), self._words, dtype=torch.int32)
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                         self._words * 4, len(matchers))
        return bitmask

    def advance(self, matcher, token: int) -> bool:
        """Consume a sampled token; True when the grammar is complete (only end-of-sequence could follow).
        Raises GrammarError when the matcher refuses it."""
        if token not in self.stop_ids:
            if not matcher.consume_token(token):
                # llguidance's error opens with the cause ("Too many items", "ParserTooComplex"), then dumps its state
                cause = (matcher.get_error() or "").split("<state>")[0].strip().splitlines()
                raise GrammarError(f"the grammar stopped: {cause[0][:200] if cause else f'token {token} not allowed'}"
                                   f"; the schema may be too complex or unsatisfiable")
            if not matcher.is_stopped():
                return False
        # end-of-sequence (a mask that nothing else can pass still lets it through), or the grammar stopped: only
        # complete if accepting; otherwise no token of the vocabulary spells what must follow
        if not matcher.is_accepting():
            raise GrammarError("the vocabulary has no token for what the schema requires next")
        return True


def unpack_bits(bitmask: torch.Tensor, v: int, device: torch.device) -> torch.Tensor:
    """(R, ceil(V / 32)) int32 on the CPU -> (R, V) int32 0/1 on `device`."""
    if device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :v]
                                ).to(torch.int32)
    return unpack_bits_on(bitmask.to(device), v)  # the packed mask crosses, 32x smaller than the bits


def unpack_bits_on(bitmask: torch.Tensor, v: int) -> torch.Tensor:
    """The same with tensor ops on the bitmask's own device (accelerators)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :v]


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """float32 logits (N, V) in place: the listed rows keep only the tokens their bitmask row allows.
    Adds 0 or -inf built from the bits by integer arithmetic: a masked_fill over a mask this irregular
    does not vectorize on CPU."""
    bits = unpack_bits(bitmask, logits.shape[1], logits.device)
    bias = bits.sub_(1).bitwise_and_(NEG_INF_BITS).view(torch.float32)  # allowed 1 -> 0.0, banned 0 -> -inf
    logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
