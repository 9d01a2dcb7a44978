"""sample_next: greedy, top-k/top-p filtering, penalties, logit bias, per-request generators."""

import pytest
import torch

from service.engine.sampling import apply_logit_bias, apply_output_penalties, make_generator, sample_next
from service.engine.types import SamplingParams

torch.set_num_threads(1)


def _logits(b=4, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def test_greedy_is_argmax():
    x = _logits()
    p = [SamplingParams(temperature=0.0)] * 4
    assert sample_next(x.clone(), p, [None] * 4, [[]] * 4) == x.argmax(-1).tolist()


def test_top_k_1_is_argmax_even_when_sampling():
    x = _logits()
    p = [SamplingParams(temperature=1.0, top_k=1)] * 4
    gens = [make_generator(i) for i in range(4)]
    assert sample_next(x.clone(), p, gens, [[]] * 4) == x.argmax(-1).tolist()


def test_tiny_temperature_and_top_p_are_greedy_not_garbage():
    # 1e-40 underflows float32 (x / 0 = inf); top_p 1e-300 rounds to 0 (every token dropped, NaN CDF)
    x = _logits()
    gens = [make_generator(i) for i in range(4)]
    for p in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-6),
              SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=0.7, top_p=1e-45)):
        assert sample_next(x.clone(), [p] * 4, gens, [[]] * 4) == x.argmax(-1).tolist(), p


def test_top_k_restricts_support():
    x = _logits(b=1, v=100)
    allowed = set(x[0].topk(5).indices.tolist())
    g = make_generator(1)
    seen = {sample_next(x.clone(), [SamplingParams(temperature=2.0, top_k=5)], [g], [[]])[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_restricts_to_nucleus():
    x = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    probs = torch.softmax(x, -1)[0]
    assert probs[0] < 0.9 < probs[0] + probs[1]
    g = make_generator(3)
    seen = {sample_next(x.clone(), [SamplingParams(temperature=1.0, top_p=0.9)], [g], [[]])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = make_generator(5)

    def seen(min_p: float, temperature: float = 1.0) -> set[int]:
        p = [SamplingParams(temperature=temperature, min_p=min_p)]
        return {sample_next(x.clone(), p, [g], [[]])[0] for _ in range(400)}

    assert seen(0.0) == {0, 1, 2, 3}
    assert seen(0.2) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert seen(0.7) == {0}  # 0.3 < 0.35
    assert seen(0.2, temperature=2.0) == {0, 1, 2, 3}  # after temperature, as vLLM: 0.05 ** 0.5 > 0.2 * 0.5 ** 0.5


def test_same_seed_same_tokens_whatever_the_batch():
    x = _logits(b=6, v=300, seed=4)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50)
    alone_seq = []
    g = make_generator(42)
    for _ in range(6):
        alone_seq.append(sample_next(x[2:3].clone(), [p], [g], [[]])[0])
    batched_seq = []
    gens = [make_generator(i) for i in range(6)]
    gens[2] = make_generator(42)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), p,
             SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.0), p]
    for _ in range(6):
        batched_seq.append(sample_next(x.clone(), mixed, gens, [[]] * 6)[2])
    assert alone_seq == batched_seq
    other = []
    g = make_generator(43)
    for _ in range(6):
        other.append(sample_next(x[2:3].clone(), [p], [g], [[]])[0])
    assert other != alone_seq


def test_a_row_without_top_k_or_top_p_samples_alike_beside_rows_with_them():
    x = _logits(b=3, v=300, seed=5)
    plain = SamplingParams(temperature=0.8)
    company = [plain, SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.9, top_p=0.8)]
    for seed in range(20):  # sorted-order sampling would pick another token for the same draw in most of these
        alone = sample_next(x[:1].clone(), [plain], [make_generator(seed)], [[]])[0]
        batched = sample_next(x.clone(), company, [make_generator(seed), make_generator(1), make_generator(2)],
                              [[]] * 3)[0]
        assert alone == batched, seed


@pytest.mark.parametrize("params", [dict(top_p=0.999), dict(top_k=3), dict(min_p=0.01)])
def test_filtered_sampling_is_as_robust_to_rounding_as_plain_sampling(params):
    """Another batch's rounding (here 1e-6) can swap two near-tied logits' ranks: the token a seed picks
    must not change with it, as it does not for unfiltered rows."""
    a = torch.tensor([[2.0, 1.0, 1.0 + 1e-6, 0.0]])
    b = torch.tensor([[2.0, 1.0 + 1e-6, 1.0, 0.0]])
    p = SamplingParams(temperature=1.0, **params)
    picks = [[sample_next(x.clone(), [p], [make_generator(seed)], [[]])[0] for seed in range(50)] for x in (a, b)]
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 1  # it did sample


def test_repetition_penalty_discourages_seen_tokens():
    x = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    p = [SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    assert sample_next(x.clone(), p, [None], [[]]) == [0]
    assert sample_next(x.clone(), p, [None], [[0, 0]]) == [1]  # 2.0/1.5 < 1.9
    y = x.clone()
    sample_next(y, p, [None], [[2]])
    assert y[0, 2].item() == -1.5  # negative logits are multiplied


def test_zero_probability_tokens_never_sampled():
    x = torch.full((3, 10), float("-inf"))
    x[:, 7] = 0.0
    gens = [make_generator(i) for i in range(3)]
    assert sample_next(x, [SamplingParams(temperature=1.0)] * 3, gens, [[]] * 3) == [7, 7, 7]


def test_presence_and_frequency_penalties_count_the_output_only():
    x = torch.zeros(2, 6)
    p = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(temperature=0.0)]
    apply_output_penalties(x, p, [[1, 1, 3], [1, 1, 3]])
    assert x[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0, 0.0]  # 2 x 0.25 + 0.5; 1 x 0.25 + 0.5
    assert x[1].tolist() == [0.0] * 6  # no penalty set: untouched
    y = torch.tensor([[1.0, 1.2, 0.0]])
    # negative penalties encourage repeats; the prompt is not counted (only the outputs passed)
    assert sample_next(y.clone(), [SamplingParams(temperature=0.0, presence_penalty=-1.0)], [None], [[]], [[0]]) == [0]
    assert sample_next(y.clone(), [SamplingParams(temperature=0.0, frequency_penalty=2.0)], [None], [[]], [[]]) == [1]


def test_logit_bias_adds_to_the_listed_tokens_only():
    x = torch.zeros(2, 5)
    apply_logit_bias(x, [SamplingParams(logit_bias={1: 3.0, 4: -100.0}), SamplingParams()])
    assert x.tolist() == [[0.0, 3.0, 0.0, 0.0, -100.0], [0.0] * 5]
    y = torch.tensor([[5.0, 0.0, 1.0]])
    assert sample_next(y.clone(), [SamplingParams(temperature=0.0, logit_bias={0: -100.0})], [None], [[]]) == [2]
    g = make_generator(0)
    banned = {sample_next(torch.zeros(1, 4), [SamplingParams(logit_bias={2: -100.0})], [g], [[]])[0]
              for _ in range(200)}
    assert banned == {0, 1, 3}
