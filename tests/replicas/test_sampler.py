"""The batched sampler: greedy rows stay argmax, top-k/top-p keep exactly their candidates, draws
follow the filtered distribution, and a seeded request's tokens do not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from replicas.protocol import SamplingParams
from replicas.request import Request
from replicas.execution.sampler import sample_logits as sample

pytestmark = pytest.mark.unit


def req(**params: object) -> Request:
    return Request("r", [1], SamplingParams(**params))  # type: ignore[arg-type]


LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))  # probabilities at temperature 1


def draws(params: dict, n: int = 4000) -> torch.Tensor:
    """Token frequencies of n seeded requests sampled in one batch."""
    rows = [req(**params, seed=i) for i in range(n)]
    tokens = sample(LOGITS.expand(n, -1).clone(), rows)
    return torch.bincount(torch.tensor(tokens), minlength=5) / n


def test_greedy_rows_and_degenerate_filters_are_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0], [0.0, 0.5, 4.0], [1.0, 5.0, 0.0]])
    rows = [req(temperature=0), req(temperature=1.0, top_k=1), req(temperature=1.5, top_p=1e-6),
            req(temperature=0)]
    assert sample(logits, rows) == [1, 0, 2, 1]


def test_draws_follow_the_filtered_distribution() -> None:
    full = draws({"temperature": 1.0})
    assert torch.allclose(full, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), atol=0.03)
    top_k = draws({"temperature": 1.0, "top_k": 2})  # 0.5 : 0.2, renormalised
    assert top_k[2:].sum() == 0 and abs(top_k[0] - 5 / 7) < 0.03
    top_p = draws({"temperature": 1.0, "top_p": 0.8})  # the smallest prefix reaching 0.8: 3 tokens
    assert top_p[3:].sum() == 0 and abs(top_p[0] - 0.5 / 0.85) < 0.03
    both = draws({"temperature": 1.0, "top_k": 3, "top_p": 0.6})  # 0.5 + 0.2 reaches 0.6
    assert both[2:].sum() == 0 and abs(both[0] - 5 / 7) < 0.03


def test_a_seeded_request_draws_the_same_whatever_its_batch() -> None:
    torch.manual_seed(0)
    steps = torch.randn(4, 6, 50)  # the logits of 4 consecutive passes

    def seeded_tokens(own: dict, batch_rows: list[int], neighbour: dict) -> list[int]:
        rows = [req(**own, seed=7) if i == 2 else req(**neighbour) for i in batch_rows]
        at = batch_rows.index(2)
        # The same Request objects every pass: the seeded one's draw count moves on step by step.
        return [sample(logits[batch_rows], rows)[at] for logits in steps]

    for own in ({"temperature": 0.9, "top_p": 0.9, "top_k": 20}, {"temperature": 0.9, "top_k": 5},
                {"temperature": 0.9, "top_p": 0.7}, {"temperature": 1.3}):
        alone = seeded_tokens(own, [2], {})
        assert seeded_tokens(own, [2], {}) == alone
        # Neighbours that widen the candidates (top_k), sort every row (top_p) or take the argmax.
        for neighbour in ({"temperature": 1.0}, {"temperature": 1.0, "top_k": 40},
                          {"temperature": 1.0, "top_p": 0.5}, {"temperature": 0.0}):
            assert seeded_tokens(own, [0, 1, 2, 3, 4, 5], neighbour) == alone, (own, neighbour)


def test_top_p_over_a_large_vocabulary_is_exact_whether_or_not_the_candidates_hold_it() -> None:
    # 1000 tokens: a peaked row (its nucleus is among the first 256 candidates) and a flat one
    # (it is not: that row sorts its whole vocabulary). Both follow the exact nucleus.
    vocab, n = 1000, 3000
    peaked = torch.full((vocab,), -20.0)
    peaked[[7, 500, 999]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))  # top_p 0.7: tokens 7 and 500
    flat = torch.zeros(vocab)
    flat[:600] = 1.0  # 600 tokens of p = e / (600 e + 400) each: top_p 0.5 keeps ceil(0.5 / p) = 374
    for logits, top_p, allowed in ((peaked, 0.7, {7, 500}), (flat, 0.5, set(range(600)))):
        rows = [req(temperature=1.0, top_p=top_p, seed=i) for i in range(n)]
        tokens = sample(logits.expand(n, -1).clone(), rows)
        assert set(tokens) <= allowed
        if logits is peaked:
            assert abs(tokens.count(7) / n - 0.5 / 0.8) < 0.03
        else:  # 374 tokens equally likely, ~8 draws each: nearly all seen, none beyond them
            counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
            kept = int((counts > 0).sum())
            assert 360 <= kept <= 374 and counts[600:].sum() == 0


def test_a_seeded_request_over_a_large_vocabulary_ignores_its_batch() -> None:
    torch.manual_seed(1)
    steps = torch.randn(3, 4, 1000) * 3  # a few hundred tokens hold most of the mass

    def tokens(own: dict, neighbour: dict, batch: bool) -> list[int]:
        rows = [req(**own, seed=11)] + ([req(**neighbour) for _ in range(3)] if batch else [])
        return [sample(logits[:len(rows)], rows)[0] for logits in steps]

    for own in ({"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0.3},
                {"temperature": 1.0}, {"temperature": 1.0, "top_k": 300}):
        alone = tokens(own, {}, batch=False)
        for neighbour in ({"temperature": 1.0, "top_k": 700}, {"temperature": 1.0, "top_p": 0.5},
                          {"temperature": 1.0}, {"temperature": 0.0}):
            assert tokens(own, neighbour, batch=True) == alone, (own, neighbour)


def test_a_seeded_request_draws_the_same_on_the_device_strategy(monkeypatch) -> None:
    """The accelerator's path (top-p rows sort their whole vocabulary, nothing read on the host)
    gives a seeded request the same tokens as the host's candidates-first path."""
    from replicas.execution import sampler

    torch.manual_seed(2)
    steps = torch.randn(4, 3, 1000) * 3
    owns = ({"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.8, "top_k": 30, "top_p": 0.5},
            {"temperature": 1.1}, {"temperature": 1.0, "top_k": 300})

    def tokens() -> list[list[int]]:
        rows = [req(**own, seed=21 + i) for i, own in enumerate(owns[:2])] + [req(temperature=0.0)]
        more = [req(**own, seed=40 + i) for i, own in enumerate(owns[2:])]
        return [sample(logits, rows) + sample(logits[:2], more) for logits in steps]

    on_host = tokens()
    monkeypatch.setattr(sampler, "is_host", lambda device: False)
    assert tokens() == on_host


def test_seeded_uniforms_are_uniform_and_independent_across_draws() -> None:
    from replicas.execution.sampler import _seed_keys, _uniforms

    r = req(temperature=1.0, seed=5)
    keys = torch.tensor([k for _ in range(2) for k in _seed_keys([r])])  # two consecutive draws
    assert r.seeded_draws == 2 and keys[0] != keys[1]
    u = _uniforms(keys, torch.arange(50_000).expand(2, -1))
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u[0], bins=10, min=0, max=1)
    assert float((counts - 5000).abs().max()) < 5000 * 0.06
    corr = torch.corrcoef(u)[0, 1]
    assert abs(float(corr)) < 0.03
