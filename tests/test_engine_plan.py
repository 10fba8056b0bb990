"""The engine's scheduling, without a model: :func:`streamattn.engine.core.plan_step` over stand-in
sequences (prompt chunks, waiting choices, drafts priced by a step-cost function, idle slots, scored
prompts) gives the tokens, counts and logit positions the step needs."""

from types import SimpleNamespace

import numpy as np

from streamattn.engine.core import plan_step


class Seq(SimpleNamespace):
    """The attributes of a Sequence that planning reads, and a proposer that drafts ``drafts`` tokens
    when the price of that many extra rows is below ``pays``."""

    def __init__(self, slot, prompt, done=None, next_token=None, drafts=(), pays=99.0, targets=None):
        done = len(prompt) if done is None else done
        super().__init__(slot=slot, job=SimpleNamespace(prompt=tuple(prompt), targets=targets), done=done,
                         next_token=next_token, draft=[], drafts=list(drafts), pays=pays, asked=[])

    @property
    def prefilling(self):
        return self.done < len(self.job.prompt)

    def plan_draft(self, limit, cost):
        k = min(len(self.drafts), limit)
        self.asked.append((limit, [cost(j) for j in range(1, k + 1)]))
        self.draft = self.drafts[:k] if k and cost(k) < self.pays else []
        return self.draft


def price(base, rows):
    return rows / base                  # as StepCosts.ratio where step time grows with every row


def never_waits(s):
    return False


def test_prefill_chunks_and_decode_rows_share_one_ragged_batch():
    a = Seq(0, range(10, 30), done=4)                       # 16 prompt tokens left: one chunk of 8
    b = Seq(2, [5, 6, 7], next_token=42)                    # decoding, no draft
    p = plan_step([a, b], 8, waits=never_waits, price=price)
    assert p.batch == 3 and p.counts.tolist() == [8, 0, 1] and p.real == 9
    assert p.tokens.shape == (3, 8)
    assert p.tokens[0].tolist() == list(range(14, 22)) and p.tokens[2].tolist() == [42] + [0] * 7
    assert p.tokens[1].tolist() == [0] * 8                  # slot 1 is idle
    assert p.rows.tolist() == [0, 2] and p.cols.tolist() == [7, 0]          # each slot's last real token
    assert p.first == {0: -7, 2: 1} and not p.only_last and not p.decoding
    assert p.feed.rows is not None and not p.feed.last_only


def test_all_decoding_without_gaps_needs_only_the_last_rows():
    p = plan_step([Seq(0, [1, 2], next_token=3), Seq(1, [4], next_token=5)], 8, waits=never_waits, price=price)
    assert p.only_last and p.feed.last_only and p.feed.rows is None and p.decoding
    assert p.counts.tolist() == [1, 1] and p.tokens.tolist() == [[3], [5]]


def test_a_draft_feeds_every_position_and_is_priced_after_the_rows_before_it():
    a = Seq(0, [1, 2], next_token=3, drafts=[7, 8, 9])
    b = Seq(1, [4], next_token=5, drafts=[6, 6])
    p = plan_step([a, b], 4, waits=never_waits, price=price)
    assert p.counts.tolist() == [4, 3] and p.decoding and not p.only_last
    assert p.tokens.tolist() == [[3, 7, 8, 9], [5, 6, 6, 0]]
    assert p.rows.tolist() == [0] * 4 + [1] * 3 and p.cols.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert p.first == {0: 0, 1: 4}
    # a's draft is priced over the 2 one-token rows; b's over those plus a's 3 drafted rows
    assert a.asked == [(3, [1.5, 2.0, 2.5])] and b.asked == [(3, [1.2, 1.4])]


def test_a_draft_the_price_refuses_is_not_fed():
    a = Seq(0, [1], next_token=3, drafts=[7, 8], pays=1.9)
    p = plan_step([a], 8, waits=never_waits, price=price)
    assert p.counts.tolist() == [1] and a.draft == [] and p.only_last


def test_a_waiting_choice_feeds_nothing_and_needs_no_logits():
    leader, follower = Seq(0, range(6), done=0), Seq(1, range(6), done=0)
    p = plan_step([leader, follower], 4, waits=lambda s: s is follower, price=price)
    assert p.counts.tolist() == [4, 0] and p.rows.tolist() == [0] and p.cols.tolist() == [3]


def test_a_scored_prompt_needs_every_position():
    s = Seq(0, range(5), done=0, targets=np.arange(5))
    p = plan_step([s], 3, waits=never_waits, price=price)
    assert p.counts.tolist() == [3] and p.cols.tolist() == [0, 1, 2] and p.first == {0: 0}
