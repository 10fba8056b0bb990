"""Cache-relative positions (StreamingLLM sec. 3.2): keys stored rotated at absolute positions, queries
rotated at their cache position for the sink keys only, equal to an oracle that rotates every key and
query at its position inside the cache."""

import numpy as np
import pytest

from streamattn import CacheSpec, attend
from streamattn.kv.reference import TOLERANCE, attention_cache_positions, cache_position, rope
from oracle import rel_err
from positions_case import PositionStream, check_gpu_plan
from gpu_fixtures import runner  # noqa: F401  (fixture)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("head_dim,window,sinks,C", [(64, 5, 2, 1), (64, 19, 3, 4), (18, 7, 1, 3), (64, 1, 4, 2)])
def test_every_step_across_wraps(backend, head_dim, window, sinks, C):
    """Every step of a stream that wraps the ring >= 3 times, chunk sizes 1..C, GQA 6/2."""
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=head_dim, window=window, sinks=sinks, max_chunk=C)
    ps = PositionStream(spec, q_heads=6, seed=head_dim + window + C)
    sizes = list(range(1, C + 1))
    total, step = 0, 0
    while total < 3 * spec.slots + sinks + window + 2:
        T = sizes[step % len(sizes)]
        q, q_sink, (ro, rl) = ps.step(T)
        out, lse = attend(q, ps.cache, backend=backend, q_sink=q_sink)
        assert rel_err(out[0], ro) <= TOLERANCE["float32"], f"step {step} (T={T}, length {total + T})"
        assert np.abs(lse[0] - rl).max() <= 1e-4, f"lse at step {step}"
        total, step = total + T, step + 1


def test_absolute_positions_drift_from_the_cache_oracle():
    """Without q_sink the kernels compute absolute positions, which the cache-position oracle rejects
    once the window has slid (the test above could not pass by ignoring q_sink)."""
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, window=4, sinks=2)
    ps = PositionStream(spec, q_heads=1, seed=3)
    errs = []
    for _ in range(40):
        q, q_sink, (ro, _) = ps.step(1)
        errs.append(rel_err(attend(q, ps.cache, backend="cpu")[0][0], ro))
    assert max(errs[:6]) <= TOLERANCE["float32"]          # nothing slid yet: the two rules agree
    assert min(errs[10:]) > 1e-3


def test_cache_positions_rule():
    assert cache_position([0, 5, 6, 7, 100], window=5, sinks=2).tolist() == [0, 5, 6, 6, 6]
    assert cache_position([0, 100], window=None).tolist() == [0, 100]


def test_oracle_equals_absolute_before_the_window_slides():
    """While nothing has left the window, cache positions are absolute positions (RoPE: the oracles agree)."""
    from streamattn.kv.reference import attention
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 9, 16)) for _ in range(3))
    pos = np.arange(9)
    want = attention(rope(q, pos, base=1e4), rope(k, pos, base=1e4), v, pos, window=7, sinks=2)
    got = attention_cache_positions(q, k, v, pos, window=7, sinks=2, base=1e4)
    assert np.abs(got[0] - want[0]).max() < 1e-12 and np.abs(got[1] - want[1]).max() < 1e-12


def test_q_sink_is_validated():
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, window=4, sinks=1)
    ps = PositionStream(spec, q_heads=2, seed=1)
    q, _, _ = ps.step(1)
    with pytest.raises(ValueError, match="q_sink must be"):
        attend(q, ps.cache, q_sink=q[:, :1])


@pytest.mark.parametrize("head_dim,C", [(64, 1), (64, 3), (128, 1)])
def test_cuda_source_on_the_emulator(runner, head_dim, C):  # noqa: F811 (fixture)
    """kernels/*.cu (decode with 2 splits for T == 1, prefill for chunks) against the cache-position
    oracle at every step, the ring wrapped >= 3 times."""
    assert check_gpu_plan(runner, head_dim=head_dim, C=C) >= 3 * 3
