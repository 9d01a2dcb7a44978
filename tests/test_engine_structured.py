"""GenerationEngine with a JSON schema per request (structured output, llguidance): the mask applies only to
the rows that ask, their output is accepted by the grammar and validates, greedy constrained decoding equals
a full-forward reference with the same mask, and refusals name the problem. Tiny random model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch
from engine_util import CharTokenizer, run_engine, tiny_llama

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.structured import Grammars, apply_bitmask, closed_objects, unpack_bits, unpack_bits_on
from service.engine.types import GenerateRequest, RequestRejected, SamplingParams

torch.set_num_threads(1)
TOK = CharTokenizer(100)  # with '{', '}' and ' ' (the default 97 ids lack the last three)
PROMPT = TOK.encode("Reply in JSON: ")
# bounded everywhere, so that even a random model completes it within max_new_tokens
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["ab", "xyz"]}, "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2}},
    "required": ["kind", "ok", "name", "n", "tags"], "additionalProperties": False}
ENUM = {"enum": ["red", "green", "blue"]}


def make_engine(**kw) -> GenerationEngine:
    tok = kw.pop("tok", TOK)
    cfg = dict(max_slots=8, max_seq_len=128, prefill_chunk=16, prefill_budget=64)
    cfg.update(kw)
    return GenerationEngine(tiny_llama(vocab_size=tok.vocab_size), tok, EngineConfig(**cfg), eos_ids={tok.eos_id})


def run(coro_fn, **kw):
    return run_engine(make_engine(**kw), coro_fn)


async def generate(engine, req) -> dict[int, dict]:
    out: dict[int, dict] = {}
    async for ev in engine.submit(req):
        c = out.setdefault(ev.index, {"text": "", "ids": [], "finish": None})
        c["text"] += ev.text
        c["ids"] += ev.token_ids
        if ev.choice_finished:
            c["finish"] = ev.finish_reason
    return out


def request(schema=None, prompt=PROMPT, n=1, max_new_tokens=90, **kw) -> GenerateRequest:
    kw.setdefault("temperature", 0.0)
    return GenerateRequest(prompt_ids=list(prompt), n=n, params=SamplingParams(
        max_new_tokens=max_new_tokens, json_schema=schema, **kw))


def accepted(schema: dict, ids: list[int]) -> bool:
    """A fresh matcher takes every token and ends complete."""
    m = Grammars(TOK, TOK.vocab_size, {TOK.eos_id}).compile(schema)
    return m.consume_tokens(ids) and m.is_accepting()


def check_valid(schema: dict, choice: dict) -> None:
    assert choice["finish"] == "stop"
    assert TOK.eos_id not in choice["ids"]  # the grammar ended it, not an end-of-sequence token
    assert accepted(schema, choice["ids"])
    jsonschema.validate(json.loads(choice["text"]), schema)


def greedy_reference(schema: dict | None, prompt: list[int], steps: int) -> list[int]:
    """Full forward per token, masked by a fresh matcher when `schema` is given, argmax."""
    model = tiny_llama(vocab_size=TOK.vocab_size)
    g = Grammars(TOK, TOK.vocab_size, {TOK.eos_id})
    m = g.compile(schema) if schema is not None else None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            x = model(torch.tensor([prompt + out])).float()[:, -1]  # (1, V)
            if m is not None:
                apply_bitmask(x, [0], g.fill([m]))
            t = int(x.argmax())
            out.append(t)
            if t == TOK.eos_id or (m is not None and g.advance(m, t)):
                break
    return out


def test_apply_bitmask_bans_exactly_the_unset_bits_on_the_listed_rows():
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)  # V = 100 < 4 * 32
    bits = unpack_bits(bitmask, 100, torch.device("cpu"))
    assert torch.equal(bits, unpack_bits_on(bitmask, 100))  # the accelerator path, run here on the CPU
    expect = [[(int(bitmask[r, i // 32]) >> (i % 32)) & 1 for i in range(100)] for r in range(3)]
    assert bits.tolist() == expect
    logits = torch.randn(5, 100, generator=g)
    out = logits.clone()
    apply_bitmask(out, [0, 2, 3], bitmask)
    for r, src in ((0, 0), (2, 1), (3, 2)):
        keep = bits[src].bool()
        assert torch.equal(out[r][keep], logits[r][keep]) and bool((out[r][~keep] == float("-inf")).all())
    assert torch.equal(out[[1, 4]], logits[[1, 4]])


def test_greedy_constrained_equals_masked_full_forward_and_validates():
    out = run(lambda e: generate(e, request(SCHEMA)))[0]
    check_valid(SCHEMA, out)
    assert out["ids"] == greedy_reference(SCHEMA, PROMPT, 90)


def test_mask_only_on_the_rows_that_ask_in_a_mixed_batch():
    """Constrained and plain requests in one continuous batch: the plain ones give exactly what they give
    alone (a mask on them would change a random model's text completely), the constrained ones validate,
    and the mask is filled for the constrained rows only."""
    prompts = [TOK.encode(t) for t in ("alpha beta", "Give JSON", "gamma", "{x", "delta epsilon zeta", "JSON:")]

    async def main(engine):
        filled: list[int] = []
        fill = engine.grammars.fill
        engine.grammars.fill = lambda ms: filled.append(len(ms)) or fill(ms)
        alone = [await generate(engine, request(None, p, max_new_tokens=40)) for p in prompts[::2]]
        steps_plain = list(filled)
        reqs = [request(None if i % 2 == 0 else (SCHEMA if i % 4 == 1 else ENUM), p,
                        max_new_tokens=40 if i % 2 == 0 else 90) for i, p in enumerate(prompts)]
        mixed = await asyncio.gather(*[generate(engine, r) for r in reqs])
        return alone, steps_plain, mixed, filled

    alone, steps_plain, mixed, filled = run(main)
    assert steps_plain == []  # no grammar in the batch: no mask work at all
    assert [m[0]["ids"] for m in mixed[::2]] == [a[0]["ids"] for a in alone]
    for i in (1, 3, 5):
        check_valid(SCHEMA if i % 4 == 1 else ENUM, mixed[i][0])
    assert filled and max(filled) <= 3  # never more rows than constrained requests


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sampled_constrained_output_is_accepted(seed):
    out = run(lambda e: generate(e, request(SCHEMA, temperature=1.0, seed=seed, top_p=0.95)))[0]
    check_valid(SCHEMA, out)


def test_each_choice_has_its_own_grammar_state():
    outs = run(lambda e: generate(e, request(SCHEMA, n=3, temperature=1.0, seed=5)))
    assert sorted(outs) == [0, 1, 2]
    for c in outs.values():
        check_valid(SCHEMA, c)
    assert len({c["text"] for c in outs.values()}) > 1


def test_json_object_mode_and_an_enum_root():
    obj = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
           "additionalProperties": False}
    outs = run(lambda e: asyncio.gather(generate(e, request(ENUM)), generate(e, request(obj))))
    check_valid(ENUM, outs[0][0])
    assert json.loads(outs[0][0]["text"]) in ENUM["enum"]
    check_valid(obj, outs[1][0])


def test_listed_properties_close_an_object_unless_the_schema_opens_it():
    """Left open, a small model invents keys; xgrammar, outlines and OpenAI's strict mode allow only the
    listed ones unless the schema says otherwise."""
    open_obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = Grammars(TOK, TOK.vocab_size, {TOK.eos_id}).compile(open_obj)
    assert m.consume_tokens(TOK.encode('{"a":1')) and not m.consume_tokens(TOK.encode(',"b"'))
    m = Grammars(TOK, TOK.vocab_size, {TOK.eos_id}).compile({**open_obj, "additionalProperties": True})
    assert m.consume_tokens(TOK.encode('{"a":1,"b":2}')) and m.is_accepting()
    m = Grammars(TOK, TOK.vocab_size, {TOK.eos_id}).compile({"type": "object"})  # JSON mode: any object
    assert m.consume_tokens(TOK.encode('{"b":2}')) and m.is_accepting()


def test_schemas_differing_only_in_property_order_are_two_grammars():
    """The grammar writes properties in the schema's order: a cached grammar of one order must not serve
    a schema of the other."""
    g = Grammars(TOK, TOK.vocab_size, {TOK.eos_id})
    props = {"a": {"enum": ["x"]}, "b": {"enum": ["y"]}}
    a_first = {"type": "object", "properties": props, "required": ["a", "b"]}
    b_first = {"type": "object", "properties": dict(reversed(props.items())), "required": ["a", "b"]}
    for schema, text in ((a_first, '{"a":"x","b":"y"}'), (b_first, '{"b":"y","a":"x"}')):
        m = g.compile(schema)
        assert m.consume_tokens(TOK.encode(text)) and m.is_accepting(), text


def test_closed_objects_walks_schemas_not_property_names():
    inner = {"type": "object", "properties": {"x": {"type": "string"}}}
    schema = {"type": "object", "properties": {"properties": inner, "items": {"type": "array", "items": inner}},
              "$defs": {"d": inner, "both": {"allOf": [inner, {"properties": {"y": {}}}]},
                        "either": {"anyOf": [inner]}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and schema.get("additionalProperties") is None  # a copy
    assert set(out["properties"]) == {"properties", "items"}  # property names are not schema keywords
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["$defs"]["either"]["anyOf"][0]["additionalProperties"] is False  # alternatives: each the whole object
    both = out["$defs"]["both"]  # closing each member would forbid the others' properties
    assert "additionalProperties" not in both and all("additionalProperties" not in s for s in both["allOf"])
    assert closed_objects({**inner, "patternProperties": {"^z": {}}}).get("additionalProperties") is None


def test_alternatives_beside_listed_properties_add_to_them():
    """An anyOf beside `properties` describes the same object: closing its members forbade the parent's
    required keys, and closing the parent the members' ("Unsatisfiable schema" for a valid schema)."""
    schema = {"type": "object", "properties": {"name": {"enum": ["n"]}}, "required": ["name"],
              "anyOf": [{"properties": {"email": {"enum": ["e"]}}, "required": ["email"]},
                        {"properties": {"phone": {"type": "integer"}}, "required": ["phone"]}]}
    g = Grammars(TOK, TOK.vocab_size, {TOK.eos_id})
    for text in ('{"name":"n","email":"e"}', '{"name":"n","phone":7}'):
        m = g.compile(schema)
        assert m.consume_tokens(TOK.encode(text)) and m.is_accepting(), text
    for refused in ('{"name":"n","phone":"x"', '{"name":"n","email":"e","zz"'):  # members' schemas; no new keys
        assert not g.compile(schema).consume_tokens(TOK.encode(refused)), refused
    m = g.compile(schema)
    assert m.consume_tokens(TOK.encode('{"name":"n"')) and not m.consume_tokens(TOK.encode("}"))  # one required


def test_a_definition_combined_by_ref_is_not_closed():
    """A `$ref` in an allOf or beside listed properties names a schema of the same object: closing that
    definition forbade the other schemas' keys ("Unsatisfiable schema", a 400 for a valid schema). A
    definition referenced on its own stays closed."""
    base = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    more = {"properties": {"b": {"enum": ["y"]}}, "required": ["b"]}
    g = Grammars(TOK, TOK.vocab_size, {TOK.eos_id})
    for schema in ({"$defs": {"B": base}, "allOf": [{"$ref": "#/$defs/B"}], **more},
                   {"$defs": {"B": base}, "$ref": "#/$defs/B", **more},
                   {"definitions": {"B": base}, "allOf": [{"$ref": "#/definitions/B"}, more]}):
        m = g.compile(schema)
        assert m.consume_tokens(TOK.encode('{"a":"x","b":"y"}')) and m.is_accepting(), schema
    alone = {"$defs": {"B": base}, "type": "object", "properties": {"o": {"$ref": "#/$defs/B"}}, "required": ["o"]}
    assert not g.compile(alone).consume_tokens(TOK.encode('{"o":{"a":"x","z"'))


def test_a_schema_combined_through_an_alias_or_a_union_is_not_closed():
    """A definition that is an alias (`{"$ref": ...}`) or a union (`anyOf`) of a base, used in an allOf, and an
    allOf member that is such a union, describe the same object as the allOf's other members: closing the base
    they lead to forbade those members' keys ("Unsatisfiable schema", a 400). So did a definition whose name
    the `$ref` spells with JSON Pointer's escapes."""
    base = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    more = {"properties": {"b": {"enum": ["y"]}}, "required": ["b"]}
    g = Grammars(TOK, TOK.vocab_size, {TOK.eos_id})
    for schema in ({"$defs": {"B": {"$ref": "#/$defs/R"}, "R": base}, "allOf": [{"$ref": "#/$defs/B"}, more]},
                   {"$defs": {"B": {"anyOf": [{"$ref": "#/$defs/R"}]}, "R": base},
                    "allOf": [{"$ref": "#/$defs/B"}, more]},
                   {"allOf": [{"anyOf": [base]}, more]},
                   {"$defs": {"a/b~": base}, "allOf": [{"$ref": "#/$defs/a~1b~0"}, more]}):
        m = g.compile(schema)
        assert m.consume_tokens(TOK.encode('{"a":"x","b":"y"}')) and m.is_accepting(), schema
    alias_alone = {"$defs": {"B": {"$ref": "#/$defs/R"}, "R": base}, "type": "object",
                   "properties": {"o": {"$ref": "#/$defs/B"}}, "required": ["o"]}
    assert not g.compile(alias_alone).consume_tokens(TOK.encode('{"o":{"a":"x","z"'))  # still closed on its own


def test_max_tokens_reached_first_is_length_with_a_prefix_of_valid_json():
    out = run(lambda e: generate(e, request(SCHEMA, max_new_tokens=5)))[0]
    assert out["finish"] == "length" and len(out["ids"]) == 5
    m = Grammars(TOK, TOK.vocab_size, {TOK.eos_id}).compile(SCHEMA)
    assert m.consume_tokens(out["ids"]) and not m.is_accepting()


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "strnig"}, "strnig"),
    # "lenient" made the grammar skip uniqueItems: the output would not follow the schema as promised
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "x-guidance is not accepted"),
    ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "x-guidance is not accepted"),
])
def test_unsupported_or_invalid_schema_is_rejected_at_submit(schema, words):
    async def main(engine):
        with pytest.raises(RequestRejected, match=words):
            engine.submit(request(schema))

    run(main)


def test_a_vocabulary_that_cannot_spell_the_json_ends_with_an_error():
    """CharTokenizer's 97 ids have no '}': the object can never close, and the engine says so (an error
    naming the request's schema field, raised to the stream's reader) instead of returning invalid JSON, or a
    diagnostic dressed up as the answer's text."""
    small = CharTokenizer()
    req = request(SCHEMA, small.encode("Reply in JSON: "))
    req.field_names = {"json_schema": "response_format"}

    async def main(engine):
        with pytest.raises(RequestRejected, match="cannot follow the schema") as e:
            await generate(engine, req)
        assert e.value.param == "response_format"
        return engine.stats()

    stats = run(main, tok=small)
    assert stats.running == 0 and stats.slots_used == 0


def test_ignore_eos_with_a_schema_is_rejected():
    async def main(engine):
        with pytest.raises(RequestRejected, match="ignore_eos"):
            engine.submit(request(SCHEMA, ignore_eos=True))

    run(main)
