"""State-machine fuzz: any interleaving of append (decode and chunks, ragged), attend, reset, fork, rewind,
snapshot and restore equals full masked attention over a plain history, on every backend, after every step.

CI runs a bounded, derandomised number of examples; ``scripts/fuzz.sh`` runs more with fresh seeds
(``STREAMATTN_FUZZ_EXAMPLES``). A planted off-by-one in the slot arithmetic must make it fail.
"""

import dataclasses
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, note, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import streamattn.kv.cache
from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import snapshot, state
from streamattn.kv.backends import gpu
from oracle import History, as_stored, check

FUZZ_EXAMPLES = int(os.environ.get("STREAMATTN_FUZZ_EXAMPLES", "0"))   # scripts/fuzz.sh sets these
FUZZ_STEPS = int(os.environ.get("STREAMATTN_FUZZ_STEPS", "30"))
CI = settings(max_examples=FUZZ_EXAMPLES or 150, stateful_step_count=FUZZ_STEPS, deadline=None,
              derandomize=not FUZZ_EXAMPLES, database=None if not FUZZ_EXAMPLES else settings().database,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NEVER = 1 << 62   # tokens appended since the last rewind, for a sequence never rewound


@st.composite
def specs(draw):
    mode = draw(st.sampled_from(["causal", "causal", "window", "sinks"]))
    window = None if mode == "causal" else draw(st.integers(1, 6))
    return CacheSpec(batch=draw(st.integers(1, 3)), kv_heads=draw(st.sampled_from([1, 2])),
                     head_dim=draw(st.sampled_from([8, 16])),
                     dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
                     window=window, sinks=draw(st.integers(1, 3)) if mode == "sinks" else 0,
                     max_chunk=draw(st.integers(1, 4)),
                     max_len=draw(st.sampled_from([None, None, 40])) if mode == "causal" else None)


class CacheStateMachine(RuleBasedStateMachine):
    """One cache beside a plain full-history model (tests/oracle.py History)."""

    device = "cpu"
    backends = ("cpu", "reference")

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="streamattn-fuzz-")
        self.saved = None          # (path, History, since_rewind, bits) of the last snapshot

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------------------
    def dev(self, x):
        return self.cache.xp.asarray(x)

    def hist_copy(self, hist):
        h = History(len(hist.k))
        h.k, h.v = [list(x) for x in hist.k], [list(x) for x in hist.v]
        return h

    def state_bits(self, cache):
        host = (lambda a: a.get() if hasattr(a, "get") else a)
        return [host(cache.k).tobytes(), host(cache.v).tobytes(), cache.lengths.tobytes(),
                cache.last_counts.tobytes(), cache.held_from.tobytes(), cache.slots]

    def index(self, data, name):
        return data.draw(st.integers(0, self.spec.batch - 1), label=name)

    # -- rules --------------------------------------------------------------------------------------
    @initialize(spec=specs(), group=st.sampled_from([1, 2]), seed=st.integers(0, 2**32 - 1),
                prefill=st.sampled_from([0, 1, 2]))
    def start(self, spec, group, seed, prefill):
        """A cache of a random spec, prefilled with 0, 1 or 2 rings' worth of decode steps (so most runs wrap)."""
        self.spec, self.q_heads, self.rng = spec, spec.kv_heads * group, np.random.default_rng(seed)
        # The history holds the values as stored, so every check is at the float32 tolerance: storage
        # rounding is the core oracle tests' business, state must not add a single bit of error.
        self.exact = dataclasses.replace(spec, dtype="float32")
        self.cache, self.hist = KVCache(spec, device=self.device), History(spec.batch)
        self.since_rewind = np.full(spec.batch, NEVER, np.int64)
        note(f"spec={spec}, q_heads={self.q_heads}")
        for _ in range(prefill * (spec.slots or 8) + prefill):
            self._append(1, np.ones(spec.batch, np.int64))

    @rule(data=st.data())
    def append(self, data):
        """Write a chunk (T=1 is decode; ragged counts, 0 allowed), then attend it on every backend."""
        s = self.spec
        T = data.draw(st.integers(1, s.max_chunk + (2 if s.window is None else 0)), label="T")
        counts = np.array(data.draw(st.lists(st.integers(0, T), min_size=s.batch, max_size=s.batch), label="counts"))
        self._append(T, counts)

    @rule(steps=st.integers(1, 12), chunk=st.booleans())
    def stream(self, steps, chunk):
        """Several full appends in a row (decode, or chunks of C), so that rings wrap within a few rules."""
        T = self.spec.max_chunk if chunk else 1
        for _ in range(steps):
            self._append(T, np.full(self.spec.batch, T))

    def _append(self, T, counts):
        """Append and attend on every backend; False when a causal max_len refuses it (cache unchanged)."""
        s = self.spec
        k, v = self.rng.standard_normal((2, s.batch, s.kv_heads, T, s.head_dim)).astype(np.float32)
        if s.max_len is not None and (self.cache.lengths + counts > s.max_len).any():
            before = self.state_bits(self.cache)
            with pytest.raises(ValueError, match=r"over max_len"):
                self.cache.append(self.dev(k), self.dev(v), counts=counts)
            assert self.state_bits(self.cache) == before
            return False
        self.cache.append(self.dev(k), self.dev(v), counts=counts)
        self.hist.append(as_stored(k, s.dtype), as_stored(v, s.dtype), counts)
        self.since_rewind += counts
        q = self.rng.standard_normal((s.batch, self.q_heads, T, s.head_dim)).astype(np.float32)
        for backend in self.backends:
            out, lse = attend(self.dev(q), self.cache, backend=backend)
            check(out, lse, q, self.hist, counts, self.exact, what=f"append T={T} counts={counts.tolist()} {backend}")
        return True

    @rule(data=st.data(), now=st.integers(0, 3))
    def reset(self, data, now):
        """Forget one sequence or all (one time in four: a reset undoes the ring wraps the fuzz needs)."""
        if now:
            return
        b = data.draw(st.one_of(st.none(), st.integers(0, self.spec.batch - 1)), label="b")
        self.cache.reset(b)
        for i in range(self.spec.batch) if b is None else [b]:
            self.hist.reset(i)
            self.since_rewind[i] = NEVER

    @rule(data=st.data())
    def fork(self, data):
        src, dst = self.index(data, "src"), self.index(data, "dst")
        state.fork(self.cache, src, dst)
        self.hist.copy(src, dst)
        self.since_rewind[dst] = self.since_rewind[src]

    @rule(data=st.data())
    def fork_through_another_cache(self, data):
        """src -> a new batch-1 cache (on the CPU, whatever this machine's device) -> dst."""
        src, dst = self.index(data, "src"), self.index(data, "dst")
        other = KVCache(dataclasses.replace(self.spec, batch=1), device="cpu")
        state.fork(self.cache, src, 0, into=other)
        h = History(1)
        self.hist.copy(src, 0, into=h)
        c = np.minimum(other.answerable(), self.spec.max_chunk)
        q = self.rng.standard_normal((1, self.q_heads, max(1, int(c[0])), self.spec.head_dim)).astype(np.float32)
        out, lse = attend(q, other, backend="cpu", counts=c)
        check(out, lse, q, h, c, self.exact, what="forked into a new cache")
        state.fork(other, 0, dst, into=self.cache)
        self.hist.copy(src, dst)
        self.since_rewind[dst] = self.since_rewind[src]

    @rule(data=st.data())
    def rewind(self, data):
        b = self.index(data, "b")
        L = int(self.cache.lengths[b])
        C = self.spec.max_chunk   # around C + 1 is where a wrapped window ring starts refusing
        k = data.draw(st.one_of(st.integers(0, L), st.sampled_from([min(L, C), min(L, C + 1), min(L, C + 2)])),
                      label="k")
        self._rewind(b, k)

    def _rewind(self, b, k):
        s, L = self.spec, int(self.cache.lengths[b])
        # What the cache must allow, from the derivation, for a sequence not rewound within the last R tokens
        must = s.window is None or (self.since_rewind[b] >= self.cache.ring and
                                    (k <= s.max_chunk or L <= s.slots or L - k <= s.sinks or s.window == 1))
        before = self.state_bits(self.cache)
        try:
            state.rewind(self.cache, b, k)
        except state.RewindError:
            event(f"rewind refused ({s.mode})")
            assert not must, f"rewind({b}, {k}) at length {L} refused but the rule allows it"
            assert self.state_bits(self.cache) == before, "a refused rewind changed the cache"
            return
        event(f"rewind allowed ({s.mode}, {'ring wrapped' if s.window and L > s.slots else 'not wrapped'})")
        self.hist.truncate(b, L - k)
        if k:
            self.since_rewind[b] = 0

    @rule(data=st.data())
    def speculate(self, data):
        """Speculative decoding: append a draft chunk of C tokens, attend it, reject a suffix of each draft."""
        if not self._append(self.spec.max_chunk, np.full(self.spec.batch, self.spec.max_chunk)):
            return                      # over a causal max_len: refused, nothing to reject
        for b in range(self.spec.batch):
            reject = data.draw(st.integers(0, self.spec.max_chunk), label=f"reject[{b}]")
            self._rewind(b, reject)

    @rule()
    def save(self):
        path = os.path.join(self.dir, "snap.npz")
        snapshot.save(path, self.cache)
        self.saved = (path, self.hist_copy(self.hist), self.since_rewind.copy(), self.state_bits(self.cache))

    @precondition(lambda self: self.saved is not None)
    @rule(how=st.sampled_from(["restore", "load", "load-cpu"]))
    def restore(self, how):
        """Back to the last snapshot, into this cache object, a new one, or a new one on the CPU."""
        path, hist, since, bits = self.saved
        if how == "restore":
            snapshot.restore(self.cache, path)
        else:
            self.cache = snapshot.load(path, spec=self.spec, device=self.device if how == "load" else "cpu")
            if how == "load-cpu" and self.device != "cpu":
                assert self.state_bits(self.cache) == bits
                self.cache = snapshot.load(path, device=self.device)
        assert self.state_bits(self.cache) == bits, "restored state is not bit-identical to the saved one"
        event(f"restore ({how})")
        self.hist, self.since_rewind = self.hist_copy(hist), since.copy()

    @rule(data=st.data())
    def save_and_load_one_sequence(self, data):
        src, dst = self.index(data, "src"), self.index(data, "dst")
        path = os.path.join(self.dir, "seq.npz")
        snapshot.save_sequence(path, self.cache, src)
        snapshot.load_sequence(path, self.cache, dst)
        self.hist.copy(src, dst)
        self.since_rewind[dst] = self.since_rewind[src]

    # -- after every rule ----------------------------------------------------------------------------
    @invariant()
    def equals_the_oracle(self):
        if not hasattr(self, "cache"):
            return
        s, cache = self.spec, self.cache
        assert cache.lengths.tolist() == [self.hist.length(b) for b in range(s.batch)]
        assert (cache.last_counts <= cache.lengths).all()
        ans = cache.answerable()
        settled = (self.since_rewind >= cache.ring) if s.window is not None else np.ones(s.batch, bool)
        expect = np.minimum(cache.lengths, s.max_chunk)
        assert (ans[settled] >= expect[settled]).all(), f"answerable {ans} < {expect} without a recent rewind"
        for b in range(s.batch):                # what the cache says it holds is the history, bit for bit
            k, v, pos = cache.temporal_view(b)
            L = int(cache.lengths[b])
            if settled[b]:
                lo = max(s.sinks, L - cache.ring) if s.window is not None else 0
                assert pos.tolist() == list(range(min(L, s.sinks))) + list(range(lo, L)), f"sequence {b} holds {pos}"
            if L:
                assert np.array_equal(k, np.concatenate(self.hist.k[b], axis=1)[:, pos]), f"K rows of sequence {b}"
                assert np.array_equal(v, np.concatenate(self.hist.v[b], axis=1)[:, pos]), f"V rows of sequence {b}"
        counts = np.minimum(ans, s.max_chunk)   # every query the cache can still answer, up to a chunk
        q = self.rng.standard_normal((s.batch, self.q_heads, max(1, int(counts.max())), s.head_dim)).astype(np.float32)
        for backend in self.backends:
            out, lse = attend(self.dev(q), cache, backend=backend, counts=counts)
            check(out, lse, q, self.hist, counts, self.exact, what=f"newest {counts.tolist()} on {backend}")


pytestmark = pytest.mark.usefixtures("one_thread")  # short sequences: one key split per (sequence, head)


class GpuCacheStateMachine(CacheStateMachine):
    device = "gpu"
    backends = ("gpu", "reference")


def test_state_machine_cpu():
    run_state_machine_as_test(CacheStateMachine, settings=CI)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="needs CuPy and a CUDA device")
def test_state_machine_gpu():
    run_state_machine_as_test(GpuCacheStateMachine, settings=CI)


def ring_offset_by_one(positions, *, sinks, ring):
    positions = np.asarray(positions)
    return np.where(positions < sinks, positions, sinks + (positions - sinks + 1) % ring)


def ring_one_short(positions, *, sinks, ring):
    positions = np.asarray(positions)
    return np.where(positions < sinks, positions, sinks + (positions - sinks) % max(ring - 1, 1))


@pytest.mark.parametrize("planted", [ring_offset_by_one, ring_one_short])
def test_fuzzer_catches_a_planted_slot_bug(monkeypatch, planted):
    """The fuzzer is only worth something if it fails on a wrong slot rule: plant one, expect a mismatch.
    The planted rule reaches what the cache says it holds (``temporal_view``) and the array write path;
    CPU writes are one compiled call (``storage.write_rows``) with its own copy of the rule, so the
    mismatch shows as stored rows that are not the history, or as attention off the oracle."""
    monkeypatch.setattr(streamattn.kv.cache, "ring_slots", planted)
    quick = settings(CI, max_examples=60, derandomize=True, database=None, phases=[Phase.generate])
    with pytest.raises(AssertionError, match=r"relative error|lse error|padding rows|[KV] rows of sequence"):
        run_state_machine_as_test(CacheStateMachine, settings=quick)


def permits_one_too_many(cache, b, k):
    # Strictly more permissive than the rule: also allows k when k - 1 is allowed (never refuses what the
    # rule allows; a plain shift by one would refuse k = length, which the rule allows: nothing left to need).
    refused = _good_refusal(cache, b, k)
    return None if refused is None or (k > 0 and _good_refusal(cache, b, k - 1) is None) else refused


def refuses_one_too_early(cache, b, k):
    return _good_refusal(cache, b, k + 1) if k < cache.lengths[b] else _good_refusal(cache, b, k)


_good_refusal = state.refusal


@pytest.mark.parametrize("planted,match", [
    (refuses_one_too_early, r"refused but the rule allows it"),
], ids=["refuses-one-too-early"])
def test_fuzzer_catches_a_rewind_rule_off_by_one(monkeypatch, planted, match):
    """One token less permissive than the rule refuses a safe rewind, and the fuzzer says so. (One token more
    permissive: the deterministic test below; 150 derandomised examples did not reliably reach that edge.)"""
    monkeypatch.setattr(state, "refusal", planted)
    quick = settings(CI, max_examples=150, derandomize=True, database=None, phases=[Phase.generate])
    with pytest.raises((AssertionError, ValueError), match=match):
        run_state_machine_as_test(CacheStateMachine, settings=quick)


def test_one_token_more_permissive_rewind_gives_wrong_attention(monkeypatch):
    """The rewind rule is exact on the permissive side too: allowing one token past it loses a key the next
    query needs, which attend's guard or the float64 oracle exposes."""
    from streamattn import CacheSpec, KVCache, attend
    from streamattn.kv.reference import TOLERANCE, attention
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=8, window=4, max_chunk=2)     # ring R = 4 + 2 - 1 = 5
    rng = np.random.default_rng(7)
    ks, vs = rng.standard_normal((2, 10, 8)).astype(np.float32)                    # [positions, d]
    cache = KVCache(spec)
    for j in range(9):                                                             # the ring has wrapped
        cache.append(ks[None, None, j:j + 1], vs[None, None, j:j + 1])
    with pytest.raises(state.RewindError):                                         # the rule: k = 3 is too far
        state.rewind(cache, 0, 3)
    monkeypatch.setattr(state, "refusal", permits_one_too_many)
    state.rewind(cache, 0, 3)                                                      # planted: allowed (L' = 6)
    cache.append(ks[None, None, 9:10], vs[None, None, 9:10])                       # the new token at position 6
    q = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    k_true = np.concatenate([ks[:6], ks[9:10]])[None]                              # history 0..5, then 6
    v_true = np.concatenate([vs[:6], vs[9:10]])[None]
    want, _ = attention(q[0], k_true, v_true, np.array([6]), window=4)
    try:
        out, _ = attend(q, cache, backend="cpu")
    except ValueError as e:                                                        # attend's own guard
        assert "can attend only its newest" in str(e)
        return
    err = np.abs(out[0] - want).max() / max(np.abs(want).max(), 1e-30)
    assert err > TOLERANCE["float32"], f"a key the query needs was lost, yet attend matched (error {err:.1e})"
