"""/v1/completions with the prompt as token ids (OpenAI allows it; lm-eval's local-completions sends
`[[ids]]` with echo + logprobs + max_tokens 1 to score a continuation), through the openai SDK: the same
answer as the text prompt, streamed and not; out-of-vocabulary ids and several prompts are 400s naming
`prompt`."""

from __future__ import annotations

import openai
import pytest
import torch
from api_util import TOK
from openai_sdk_util import BAN_SPECIALS, MODEL, TOL, completion, reference, served

torch.set_num_threads(1)
TEXT = "The,cat-sat.on"  # the tiny vocabulary has no space


@pytest.fixture(scope="module")
def client():
    with served() as (c, _):
        yield c


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", ["ids", "list of ids"])
def test_token_prompt_equals_text_prompt(client, stream, shape):
    ids = TOK.encode(TEXT)
    prompt = ids if shape == "ids" else [ids]
    kw = dict(max_tokens=8, temperature=0, logit_bias=BAN_SPECIALS, echo=True, logprobs=2)
    by_ids, usage = completion(client, stream, prompt=prompt, **kw)
    by_text, usage_text = completion(client, stream, prompt=TEXT, **kw)
    assert by_ids == by_text and usage == usage_text
    assert by_ids[0]["text"].startswith(TEXT)


def test_lm_eval_scoring_request_matches_a_full_forward(client):
    """What local-completions sends for a loglikelihood request: prompt [[context + continuation]], echo,
    logprobs 1, max_tokens 1, temperature 0. The continuation's summed logprob is a full forward's."""
    context, continuation = TOK.encode("Q: 2+2? A:"), TOK.encode(" 4")
    ids = context + continuation
    out = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                                    seed=1234)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    ref = reference(ids)
    want = sum(float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    got = sum(lp.token_logprobs[len(context): len(ids)])
    assert abs(got - want) < TOL * len(continuation)
    for i in range(1, len(ids)):  # what lm-eval's is_greedy test reads: the prompt token and the top 1
        top = lp.top_logprobs[i]
        assert top[TOK.decode([ids[i]])] == pytest.approx(lp.token_logprobs[i], abs=TOL)
        assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=TOL)


@pytest.mark.parametrize("prompt, words", [
    ([5, 10, TOK.vocab_size], "token ids must be in [0, 97)"),
    ([[5, 6], [7, 8]], "batched prompts are not supported"),
    (["a", "b"], "batched prompts are not supported"),
    ([-1, 5], "greater than or equal to 0"),
    ([[]], "prompt is empty"),
])
def test_bad_token_prompts_are_400s_naming_prompt(client, prompt, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert e.value.param.startswith("prompt") and words in e.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_scored_prompt_whose_one_token_is_end_of_sequence_still_has_its_entry(client, stream):
    """lm-eval drops the last entry as the generated token: an end-of-sequence token (no text) must still
    have one, or the continuation's last token would be dropped instead."""
    ids = TOK.encode(TEXT)
    choices, usage = completion(client, stream, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                                logit_bias={str(TOK.eos_id): 100})
    c = choices[0]
    assert c["finish_reason"] == "stop" and c["text"] == TEXT and usage["completion_tokens"] == 1
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][-1] == pytest.approx(float(reference(ids)[-1, TOK.eos_id]), abs=TOL)
