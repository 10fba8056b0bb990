"""The n-gram proposer's incremental index and its drafts round a repeating tail (no model needed)."""

import numpy as np
import pytest

from streamattn.engine.speculative import NgramProposer, SpecParams, StepCosts


def test_a_repeating_tail_gets_a_full_draft():
    p = NgramProposer(SpecParams(n_min=2, n_max=4))
    draft, match = p.lookup([9] + [1, 2, 3] * 6, 8)
    assert draft == [1, 2, 3, 1, 2, 3, 1, 2] and match >= 3              # round the 3-token period
    # the match does not reach back over the continuation: only what followed the occurrence
    assert p.lookup([7, 1, 2, 9, 9, 1, 2], 6) == ([9, 9, 1, 2], 2)


def test_the_index_grown_in_place_agrees_with_a_fresh_one():
    rng = np.random.default_rng(3)
    params = SpecParams(n_min=2, n_max=4)
    grown, ctx = NgramProposer(params), []
    for step in range(300):
        ctx += [int(x) for x in rng.integers(0, 6, int(rng.integers(1, 4)))]     # appends, as a sequence's
        k = int(rng.integers(1, 9))
        assert grown.lookup(ctx, k) == NgramProposer(params).lookup(list(ctx), k), step


def test_a_context_that_is_no_extension_is_indexed_afresh():
    params = SpecParams(n_min=2, n_max=3)
    p = NgramProposer(params)
    assert p.lookup([1, 2, 3, 1, 2], 2) == ([3, 1], 2)
    other = [4, 5, 6, 4, 5]                                             # another list, not an extension
    assert p.lookup(other, 2) == NgramProposer(params).lookup(list(other), 2) == ([6, 4], 2)
    shorter = [4, 5, 6]
    assert p.lookup(shorter, 2) == ([], 0)                               # the old n-grams are gone


def test_more_rows_are_never_priced_below_fewer():
    c = StepCosts()
    for rows, t in ((1, 10.0), (2, 14.0), (3, 12.0), (5, 13.0)):        # 3 and 5 rows timed on a quiet spell
        c.record(rows, t)
    assert c.ratio(1, 2) == pytest.approx(1.4)
    assert c.ratio(1, 3) == c.ratio(1, 4) == c.ratio(1, 5) == pytest.approx(1.4)        # not below the 2-row step
    assert c.ratio(1, 6) == pytest.approx(1.3 + StepCosts.PRIOR_SLOPE)                  # past them: from the last timed
    assert c.ratio(2, 5) == 1.0                                          # >= 1 against any base
