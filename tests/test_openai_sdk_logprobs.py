"""logprobs through the official `openai` SDK, streamed and not: completions `logprobs` (with and without
`echo`, `max_tokens: 0` scoring) and chat `logprobs` + `top_logprobs`, equal to a full forward of the
model (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from api_util import TOK
from openai_sdk_util import (
    BAN_SPECIALS,
    TOL,
    chat,
    completion,
    ids_of,
    reference,
    same_up_to_float,
    served,
    tokenize,
)

torch.set_num_threads(1)
PROMPT = "Hello,world.Abc"
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


@pytest.fixture(scope="module")
def server():
    with served() as s:
        yield s


def check_completion_logprobs(lp: dict, ids: list[int], start: int, k: int) -> None:
    """lp's tokens are ids[start:]; each logprob and top alternative equals the reference."""
    ref = reference(ids)
    assert ids_of(lp["tokens"]) == ids[start:]
    assert lp["text_offset"] == list(range(len(ids) - start))  # one character per token
    for j, (tid, got, top) in enumerate(zip(ids[start:], lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        pos = start + j
        if pos == 0:
            assert got is None and top is None  # the first prompt token has nothing before it
            continue
        assert abs(got - ref[pos - 1, tid].item()) < TOL
        # keyed by token text, the chosen token included (special tokens decode to "": one key)
        want = {TOK.decode([t]): ref[pos - 1, t].item() for t in ref[pos - 1].topk(k).indices.tolist()}
        want.setdefault(TOK.decode([tid]), ref[pos - 1, tid].item())
        assert top.keys() == want.keys()
        assert all(abs(top[t] - want[t]) < TOL for t in want)


@STREAM
def test_completion_logprobs_match_a_full_forward(server, stream):
    client, _ = server
    choices, usage = completion(client, stream, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                logit_bias=BAN_SPECIALS)
    c = choices[0]
    p_ids = TOK.encode(PROMPT)
    out_ids = ids_of(c["logprobs"]["tokens"])
    assert c["text"] == "".join(c["logprobs"]["tokens"]) and len(out_ids) == 6 and c["finish_reason"] == "length"
    check_completion_logprobs(c["logprobs"], p_ids + out_ids, len(p_ids), 3)
    assert usage == {"prompt_tokens": len(p_ids), "completion_tokens": 6, "total_tokens": len(p_ids) + 6}


@STREAM
def test_echo_with_max_tokens_0_scores_the_prompt(server, stream):
    client, _ = server
    choices, usage = completion(client, stream, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = choices[0]
    p_ids = TOK.encode(PROMPT)
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    check_completion_logprobs(c["logprobs"], p_ids, 0, 2)
    assert usage == {"prompt_tokens": len(p_ids), "completion_tokens": 0, "total_tokens": len(p_ids)}
    plain, _ = completion(client, stream, prompt=PROMPT, max_tokens=0, echo=True)  # echo alone: no logprobs
    assert plain[0] == {"text": PROMPT, "finish_reason": "length", "logprobs": None}


@STREAM
def test_echo_then_generation_covers_prompt_and_output(server, stream):
    client, _ = server
    choices, _ = completion(client, stream, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0,
                            logit_bias=BAN_SPECIALS)
    c = choices[0]
    p_ids = TOK.encode(PROMPT)
    assert c["text"].startswith(PROMPT) and len(c["logprobs"]["tokens"]) == len(p_ids) + 4
    check_completion_logprobs(c["logprobs"], p_ids + ids_of(c["logprobs"]["tokens"][len(p_ids):]), 0, 1)


def test_streamed_logprobs_equal_the_whole_response(server):
    client, _ = server
    kw = dict(prompt=PROMPT, max_tokens=5, echo=True, logprobs=4, temperature=0, logit_bias=BAN_SPECIALS)
    assert same_up_to_float(completion(client, True, **kw), completion(client, False, **kw))
    msgs = [{"role": "user", "content": "Hi"}]
    kw = dict(messages=msgs, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0, logit_bias=BAN_SPECIALS)
    assert same_up_to_float(chat(client, True, **kw), chat(client, False, **kw))


@STREAM
def test_chat_logprobs_match_a_full_forward(server, stream):
    client, url = server
    msgs = [{"role": "system", "content": "Brief."}, {"role": "user", "content": "Hi!"}]
    choices, usage = chat(client, stream, messages=msgs, max_completion_tokens=5, temperature=0, logprobs=True,
                          top_logprobs=4, logit_bias=BAN_SPECIALS)
    c = choices[0]
    p_ids = tokenize(url, messages=msgs)
    out_ids = ids_of([e["token"] for e in c["logprobs"]])
    assert c["content"] == "".join(e["token"] for e in c["logprobs"]) and len(out_ids) == 5
    ref = reference(p_ids + out_ids)
    for j, (tid, e) in enumerate(zip(out_ids, c["logprobs"], strict=True)):
        row = ref[len(p_ids) - 1 + j]
        assert abs(e["logprob"] - row[tid].item()) < TOL and e["bytes"] == list(e["token"].encode())
        want = row.topk(4)
        assert [t["token"] for t in e["top_logprobs"]] == [TOK.decode([i]) for i in want.indices.tolist()]
        for t, v in zip(e["top_logprobs"], want.values.tolist(), strict=True):
            assert abs(t["logprob"] - v) < TOL and t["bytes"] == list(t["token"].encode())
    assert usage["prompt_tokens"] == len(p_ids) and usage["completion_tokens"] == 5


@STREAM
def test_chat_logprobs_without_top_and_off(server, stream):
    client, _ = server
    msgs = [{"role": "user", "content": "Hi"}]
    choices, _ = chat(client, stream, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                      logit_bias=BAN_SPECIALS)
    assert len(choices[0]["logprobs"]) == 3 and all(e["top_logprobs"] == [] for e in choices[0]["logprobs"])
    choices, _ = chat(client, stream, messages=msgs, max_tokens=3, temperature=0, top_logprobs=0, logprobs=True,
                      logit_bias=BAN_SPECIALS)
    assert all(e["top_logprobs"] == [] for e in choices[0]["logprobs"])
    choices, _ = chat(client, stream, messages=msgs, max_tokens=3, temperature=0)
    assert choices[0]["logprobs"] is None
