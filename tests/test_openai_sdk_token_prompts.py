"""/v1/completions with the prompt as token ids (OpenAI allows it; lm-eval's local-completions sends
`[[ids]]` with echo + logprobs + max_tokens 1 to score a continuation), through the openai SDK: the same
answer as the text prompt, streamed and not; out-of-vocabulary ids are 400s naming `prompt`. A batch of
prompts (lm-eval's batch_size > 1) answers as the prompts sent one by one, choices in OpenAI's order."""

from __future__ import annotations

import openai
import pytest
import torch
from api_util import TOK
from openai_sdk_util import BAN_SPECIALS, MODEL, TOL, completion, reference, served

from service.config import ApiLimits

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
    ([[5, 6], [7, TOK.vocab_size]], "prompt.1: token ids must be in [0, 97)"),
    (["a", "b", "c"], "3 prompts given; the limit is 2"),
    ([-1, 5], "greater than or equal to 0"),
    ([[]], "prompt is empty"),
])
def test_bad_token_prompts_are_400s_naming_prompt(small_batches, prompt, words):
    with pytest.raises(openai.BadRequestError) as e:
        small_batches.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert e.value.param.startswith("prompt") and words in e.value.message


@pytest.fixture(scope="module")
def small_batches():
    with served(ApiLimits(max_prompts=2)) as (c, _):
        yield c


def same_choice(got: dict, want: dict) -> None:
    """Equal text, finish and tokens; logprobs within TOL (rows batched together round differently)."""
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
    g, w = got["logprobs"], want["logprobs"]
    assert (g["tokens"], g["text_offset"]) == (w["tokens"], w["text_offset"])
    assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=TOL, nan_ok=True)
    for a, b in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=TOL))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", ["texts", "ids"])
def test_a_batch_of_prompts_answers_as_each_prompt_alone(client, stream, shape):
    """Prompt i's choice j is choice i * n + j (OpenAI's and vLLM's order), its text, logprobs and seeded
    samples those of the prompt sent alone; usage is the sum over the prompts."""
    texts = [TEXT, "sat.on", "The,cat"]
    prompts = texts if shape == "texts" else [TOK.encode(t) for t in texts]
    kw = dict(n=2, max_tokens=6, temperature=1.0, seed=7, logit_bias=BAN_SPECIALS, echo=True, logprobs=2)
    batch, usage = completion(client, stream, prompt=prompts, **kw)
    assert sorted(batch) == list(range(6))
    total = dict.fromkeys(usage, 0)
    for i, p in enumerate(prompts):
        alone, alone_usage = completion(client, stream, prompt=p, **kw)
        for j in range(2):
            same_choice(batch[i * 2 + j], alone[j])
        assert alone[0]["text"].startswith(texts[i])
        total = {k: total[k] + alone_usage[k] for k in total}
    assert usage == total
    assert batch[0]["text"] != batch[1]["text"] or batch[2]["text"] != batch[3]["text"]  # seeds differ per choice


def test_best_of_picks_within_each_prompt_of_a_batch(client):
    kw = dict(n=1, best_of=3, max_tokens=5, temperature=1.0, seed=3, logit_bias=BAN_SPECIALS)
    out = client.completions.create(model=MODEL, prompt=["The,", "sat."], **kw)
    assert [c.index for c in out.choices] == [0, 1]
    for c, p in zip(out.choices, ["The,", "sat."], strict=True):
        assert c.text == client.completions.create(model=MODEL, prompt=p, **kw).choices[0].text


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
