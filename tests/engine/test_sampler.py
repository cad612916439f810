"""Batched sampler: greedy, truncation, seeded reproducibility, distribution, penalties, bias, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import SamplingBatch, _top_p_threshold, argmax_rows, process_logits, sample
from engine.sampling_params import SamplingParams

V = 64


def build(
    params: list[SamplingParams],
    vocab: int = V,
    seeds: list[int | None] | None = None,
    steps: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    banned: list[tuple[int, ...]] | None = None,
) -> SamplingBatch:
    n = len(params)
    empty: list[list[int]] = [[] for _ in range(n)]
    return SamplingBatch.build(params, output_ids or empty, prompt_ids or empty, seeds or [None] * n,
                               steps or [0] * n, vocab, banned)


def crafted(vocab: int = 8) -> torch.Tensor:
    """Logits of probabilities 0.4, 0.3, 0.15, 0.1, 0.05 and a negligible tail, in a shuffled id order."""
    probs = torch.full((vocab,), 1e-9)
    probs[torch.tensor([5, 2, 7, 0, 3])] = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    return probs.log()


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    batch = build([params] * n, vocab=logits_row.numel())
    return sample(logits_row.expand(n, -1).contiguous(), batch).token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, V)
    batch = build([SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(sample(logits, batch).token_ids, logits.argmax(-1))


def test_argmax_rows_takes_the_first_maximum_like_torch() -> None:
    logits = torch.randn(5, 2 * V)[:, ::2]  # strided, as the sliced logits of a padded vocabulary are
    logits[1, 3] = logits[1, 7] = logits[1].max() + 1  # a tie: the lower index wins
    logits[2, :] = 0.0
    logits[3, 11] = math.inf
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(-1)) and got[1] == 3 and got[2] == 0 and got[3] == 11
    assert torch.equal(argmax_rows(logits.bfloat16()), logits.bfloat16().argmax(-1))


def test_plain_greedy_is_only_greedy_without_logit_edits_or_logprobs() -> None:
    assert SamplingParams(temperature=0.0).plain_greedy and SamplingParams(temperature=1e-6).plain_greedy
    for p in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.0, repetition_penalty=1.1),
              SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0, logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0, top_logprobs=2)):
        assert not p.plain_greedy, p


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    for _ in range(20):
        tokens = sample(logits, build(params)).token_ids
        assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
@pytest.mark.parametrize("with_top_p_row", [False, True])  # a top-p row forces the sorted path
def test_top_k_1_is_greedy(temperature: float, with_top_p_row: bool) -> None:
    torch.manual_seed(1)
    logits = torch.randn(9, V)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 8
    params.append(SamplingParams(top_p=0.5 if with_top_p_row else 1.0))
    for _ in range(10):
        tokens = sample(logits, build(params)).token_ids
        assert torch.equal(tokens[:8], logits[:8].argmax(-1))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {5, 2}),
        (SamplingParams(top_k=3, temperature=3.0), {5, 2, 7}),
        (SamplingParams(top_p=0.75), {5, 2, 7}),  # mass before 7 is 0.7 < 0.75, before 0 is 0.85
        (SamplingParams(top_p=0.35), {5}),
        (SamplingParams(min_p=0.3), {5, 2, 7}),  # p >= 0.12
        (SamplingParams(min_p=0.3, temperature=0.5), {5, 2}),  # p ∝ p^2: 0.15^2/0.4^2 = 0.14 < 0.3
        # top-p on the top-k-renormalised mass: 0.4/0.95 + 0.3/0.95 = 0.74 < 0.85, + 0.15/0.95 = 0.89
        (SamplingParams(top_k=4, top_p=0.85, min_p=0.2), {5, 2, 7}),
        (SamplingParams(top_k=4, top_p=0.85, min_p=0.4), {5, 2}),  # 0.15 / 0.4 < 0.4
        (SamplingParams(top_k=4, temperature=50.0), {5, 2, 7, 0}),  # flattened, still only 4
    ],
)
def test_truncation_never_leaves_the_allowed_set(params: SamplingParams, allowed: set[int]) -> None:
    torch.manual_seed(2)
    seen = set(draws(crafted(), params).tolist())
    assert seen == allowed  # nothing outside, and every allowed token does occur over 4000 draws


def test_truncation_per_row_in_one_batch() -> None:
    """Rows with different settings in one batch each keep their own allowed set."""
    torch.manual_seed(3)
    settings = [(SamplingParams(top_k=2), {5, 2}), (SamplingParams(), {5, 2, 7, 0, 3}),
                (SamplingParams(top_p=0.75), {5, 2, 7}), (SamplingParams(min_p=0.3), {5, 2, 7})]
    n = 3000
    params = [p for p, _ in settings for _ in range(n)]
    tokens = sample(crafted().expand(len(params), -1).contiguous(), build(params, vocab=8)).token_ids
    for i, (_, allowed) in enumerate(settings):
        assert set(tokens[i * n:(i + 1) * n].tolist()) == allowed


def seeded_run(row: int, others: list[SamplingParams], seed: int, logits: torch.Tensor, steps: int = 30) -> list[int]:
    """Tokens of a seeded row placed at `row` among `others`, over `steps` steps with fixed logits."""
    me = SamplingParams(temperature=1.0, top_k=40, min_p=0.01)
    params = others[:row] + [me] + others[row:]
    seeds: list[int | None] = [None] * len(params)
    seeds[row] = seed
    out = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the global RNG (unseeded rows) differs per call; must not matter
        batch = build(params, seeds=seeds, steps=[step] * len(params))
        rows = logits.expand(len(params), -1).contiguous()
        out.append(int(sample(rows, batch).token_ids[row]))
    return out


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = torch.randn(V) * 0.5  # flat enough that draws vary
    alone = seeded_run(0, [], 42, logits)
    crowd = [SamplingParams(top_p=0.6), SamplingParams(temperature=0.0), SamplingParams(top_k=3),
             SamplingParams(temperature=2.0, repetition_penalty=1.3)]
    assert seeded_run(2, crowd, 42, logits) == alone  # top-p neighbour: sorted path
    assert seeded_run(1, crowd[1:2], 42, logits) == alone
    assert seeded_run(0, crowd[2:], 42, logits) == alone
    assert len(set(alone)) > 5  # it really samples


def test_different_seeds_differ() -> None:
    logits = torch.randn(V) * 0.5
    runs = {tuple(seeded_run(0, [], seed, logits)) for seed in range(5)}
    assert len(runs) == 5


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distribution_matches_softmax(temperature: float) -> None:
    torch.manual_seed(4)
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    tokens = draws(logits, SamplingParams(temperature=temperature), n=20000)
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    expected = torch.softmax(logits.double() / temperature, -1)
    assert (freq - expected).abs().max() < 0.02  # ~6 standard deviations


def test_seeded_draws_follow_the_distribution() -> None:
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    n = 5000
    batch = build([SamplingParams()] * n, vocab=4, seeds=list(range(n)))
    tokens = sample(logits.expand(n, -1).contiguous(), batch).token_ids
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert (freq - torch.tensor([0.1, 0.2, 0.3, 0.4]).double()).abs().max() < 0.03


def reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """Straightforward per-row, per-token version of the vLLM / OpenAI rules."""
    out = logits.clone()
    for r, p in enumerate(params):
        for t in set(prompts[r]) | set(outputs[r]):
            x = float(out[r, t])
            out[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(outputs[r]):
            out[r, t] -= p.frequency_penalty * outputs[r].count(t) + p.presence_penalty
        for t, b in p.logit_bias.items():
            out[r, t] += b
    return out


def test_penalties_match_reference() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, V) * 3
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.7),
        SamplingParams(repetition_penalty=0.8, logit_bias={3: 2.5, 10: -1.0}),
        SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3, 3], [3, 4, 5], [6, 7], [1, 2]]
    outputs = [[2, 9, 9, 9, 11], [4, 12, 12], [7, 7, 20], [3, 3]]
    batch = build(params, prompt_ids=prompts, output_ids=outputs)
    expected = reference_penalties(logits, params, prompts, outputs)
    assert torch.allclose(process_logits(logits, batch), expected, atol=1e-5)
    assert not torch.allclose(expected, logits)  # the case really exercises the penalties
    greedy = [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in params]
    got = sample(logits, build(greedy, prompt_ids=prompts, output_ids=outputs)).token_ids
    assert torch.equal(got, expected.argmax(-1))


def test_logit_bias_bans_and_forces() -> None:
    torch.manual_seed(6)
    logits = torch.zeros(V)
    logits[3] = 10.0  # the overwhelming favourite
    banned = draws(logits, SamplingParams(logit_bias={3: -100.0}), n=2000)
    assert 3 not in set(banned.tolist())
    greedy = sample(logits[None], build([SamplingParams(temperature=0.0, logit_bias={3: -100.0})])).token_ids
    assert int(greedy[0]) != 3
    forced = draws(torch.zeros(V), SamplingParams(logit_bias={17: 100.0}), n=500)
    assert set(forced.tolist()) == {17}


def test_banned_ids_are_never_sampled_and_report_minus_inf() -> None:
    torch.manual_seed(7)
    logits = torch.zeros(2, V)
    logits[:, 0] = 20.0  # "eos" dominates
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(logprobs=True)]
    batch = build(params, banned=[(0,), (0, 1)])
    for _ in range(50):
        res = sample(logits, batch)
        assert int(res.token_ids[0]) != 0 and int(res.token_ids[1]) not in (0, 1)
        assert torch.isfinite(res.logprobs).all()
    lp = torch.log_softmax(process_logits(logits, batch), -1)
    assert lp[0, 0] == -math.inf and lp[1, 1] == -math.inf


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    torch.manual_seed(8)
    logits = torch.randn(5, V) * 2
    params = [SamplingParams(temperature=t, logprobs=True, top_logprobs=k)
              for t, k in [(0.0, 5), (0.7, 3), (1.3, 0), (0.0, 0), (2.0, 1)]]
    for batch in (build(params), build([SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)] * 5)):
        res = sample(logits, batch)
        ref = torch.log_softmax(logits, -1)  # before temperature, whatever each row's temperature
        assert torch.allclose(res.logprobs, ref.gather(1, res.token_ids[:, None]).squeeze(1))
        assert res.top_ids is not None and res.top_logprobs is not None
        assert res.top_ids.shape == (5, 5)
        assert (res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all()  # best first
        assert torch.allclose(res.top_logprobs, ref.gather(1, res.top_ids))
        assert torch.equal(res.top_ids[:, 0], logits.argmax(-1))


def test_no_logprobs_unless_asked() -> None:
    res = sample(torch.randn(3, V), build([SamplingParams(), SamplingParams(temperature=0.0)] + [SamplingParams()]))
    assert res.logprobs is None and res.top_ids is None and res.top_logprobs is None
    res = sample(torch.randn(2, V), build([SamplingParams(logprobs=True), SamplingParams()]))
    assert res.logprobs is not None and res.top_ids is None


def test_build_rejects_out_of_vocab_bias() -> None:
    with pytest.raises(ValueError):
        build([SamplingParams(logit_bias={V: 1.0})])


def reference_top_p_set(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest most-likely set whose mass reaches top_p, by a plain sort."""
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for t in order:
        if mass >= top_p:
            break
        kept.add(t)
        mass += float(probs[t])
    return kept


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked: the set ends in the top 64; flat: it needs the full sort
def test_top_p_set_matches_a_plain_sort(scale: float) -> None:
    torch.manual_seed(9)
    vocab, n = 500, 4000
    row = torch.randn(vocab) * scale
    allowed = reference_top_p_set(torch.softmax(row.double(), -1), 0.8)
    assert (len(allowed) < 64) == (scale > 1)
    tokens = set(draws(row, SamplingParams(top_p=0.8), n=n).tolist())
    assert tokens <= allowed
    if len(allowed) < 64:
        assert tokens == allowed
    else:
        assert len(tokens) > 0.9 * len(allowed)  # the set really reaches past the first 64 ranks


def test_seeded_top_p_row_ignores_its_neighbours() -> None:
    """A flat top-p row goes through the sort stage; peaked neighbours stop early. Neither changes its token."""
    torch.manual_seed(10)
    vocab = 500
    flat, peaked = torch.randn(vocab) * 0.3, torch.randn(vocab) * 8
    me = SamplingParams(top_p=0.9)

    def token(others: int, position: int, step: int) -> int:
        rows = [peaked] * others
        rows.insert(position, flat)
        params = [SamplingParams(top_p=0.5)] * others
        params.insert(position, me)
        seeds: list[int | None] = [None] * others
        seeds.insert(position, 7)
        batch = build(params, vocab=vocab, seeds=seeds, steps=[step] * (others + 1))
        return int(sample(torch.stack(rows), batch).token_ids[position])

    alone = [token(0, 0, s) for s in range(20)]
    assert [token(3, 2, s) for s in range(20)] == alone
    assert [token(5, 5, s) for s in range(20)] == alone
    assert len(set(alone)) > 10


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(4, V) * 50
    params = [SamplingParams(temperature=1e-7)] * 2 + [SamplingParams(temperature=1e-7, top_p=0.5)] * 2
    assert torch.equal(sample(logits, build(params)).token_ids, logits.argmax(-1))


def test_top_p_threshold_is_the_full_ranking_s_at_every_stage() -> None:
    # Rows whose top-p set ends within the best 64, within the best 2048, and beyond (full sort), in one batch.
    vocab = 6000
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(3, vocab, generator=g) * 1e-3
    weights[0, :10] = 1.0
    weights[1, :500] = 1.0
    weights[2] = torch.rand(vocab, generator=g)
    top_p = torch.tensor([0.9, 0.9, 0.9])
    got = _top_p_threshold(weights, top_p)
    for r in range(3):
        ranked = weights[r].sort(descending=True).values
        kept = int(((ranked.cumsum(0) - ranked) < top_p[r] * weights[r].sum()).sum())
        assert got[r, 0] == ranked[kept - 1], r
