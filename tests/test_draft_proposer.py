"""The n-gram proposer's incremental index and its drafts round a repeating tail (no model needed)."""

import numpy as np

from streamattn.engine.speculative import NgramProposer, SpecParams


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
