"""Benchmark helpers for shared hosts: the noisy neighbour (streamattn/bench/noise.py) is bounded and always
reaped, and the bytes of a decode step (streamattn/bench/memory_wall.py) match a hand count."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from streamattn.bench import memory_wall
from streamattn.bench.noise import Noise
from streamattn.bench.peer_home import peer_home
from tests._model_util import write_tiny_gguf


def _gone(pid: int) -> bool:
    """No such process, or a zombie: it no longer runs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_noise_keeps_its_duty_and_is_reaped():
    with Noise(0.5, period_ms=10) as n:
        pid = n.proc.pid
        time.sleep(1.2)
    assert _gone(pid) and n.proc is None
    # half of one core: a generous band, the host is shared (a busy loop reads ~1, a sleeper ~0)
    assert 0.1 < n.cpu_s / n.wall_s < 0.8, (n.cpu_s, n.wall_s)


def test_noise_is_reaped_on_an_exception_and_absent_at_duty_zero():
    with pytest.raises(KeyboardInterrupt):
        with Noise(0.5) as n:
            pid = n.proc.pid
            raise KeyboardInterrupt
    assert _gone(pid)
    with Noise(0.0) as quiet:
        assert quiet.proc is None


def test_noise_ends_by_itself_after_its_lifetime_and_with_its_parent():
    with Noise(0.5, lifetime=0.3) as n:
        assert n.proc.wait(timeout=20) == 0                 # exited by itself, before the block ended
    parent = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(memory_wall.__file__).parent)!r})
        from noise import Noise
        n = Noise(0.5, lifetime=60).__enter__()
        print(n.proc.pid, flush=True)
        os._exit(0)                                          # no cleanup: as if killed
        """)], capture_output=True, text=True, timeout=60)
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


@pytest.mark.parametrize("kw, what", [({"duty": 1.5}, "duty"), ({"duty": -0.1}, "duty"),
                                      ({"period_ms": 0.1}, "period_ms"), ({"lifetime": 0}, "lifetime")])
def test_noise_refuses_bad_settings_by_name(kw, what):
    with pytest.raises(ValueError, match=what):
        Noise(**{"duty": 0.5, **kw})


def test_peer_home_of_a_checkout_with_its_own_peers(tmp_path):
    (tmp_path / ".peer").mkdir()
    assert peer_home(tmp_path) == tmp_path / ".peer"
    assert peer_home(tmp_path / "nowhere") == tmp_path / "nowhere" / ".peer"      # absent: callers explain


# ------------------------------------------------------------------------------ bytes of a decode step
F32, Q8_0 = 4, 34 / 32                 # bytes per weight: float32, Q8_0 (fp16 scale + 32 int8 per block)
D, Q, KV, FF, VOCAB = 32, 4 * 16, 16, 64, 64      # d_model, q rows, k/v rows, d_ff, vocabulary


def _layer_bytes():
    norms = (D + D + D + D + 16 + 16) * F32       # attn, ffn, post-attention, post-ffw norms; q and k norms
    attn = (Q * D + KV * D + KV * D + D * Q) * F32
    mlp = FF * D * Q8_0 + FF * D * F32 + D * FF * Q8_0          # gate (Q8_0), up (f32), down (Q8_0)
    return norms + attn + mlp


def test_step_bytes_of_a_tiny_tied_model_against_a_hand_count(tmp_path):
    path = write_tiny_gguf(tmp_path / "g.gguf", arch="gemma3", n_layers=6, d_model=D, d_ff=FF, vocab=VOCAB,
                           window=4, quant={"ffn_gate": "Q8_0", "ffn_down": "Q8_0"})
    prof = memory_wall.profile(path)
    embd = VOCAB * D * F32
    assert prof["tied"] and prof["weights"] == 6 * _layer_bytes() + D * F32 + embd + D * F32    # + one row
    assert prof["windows"] == [4, 4, 4, 4, 4, None] and prof["kv_per_key"] == [2 * 16 * 2] * 6
    # position 2 sees 3 keys everywhere; position 10: 4 in the five window layers, 11 in the global one
    assert memory_wall.step_bytes(prof, 2) == prof["weights"] + 6 * 64 * 3
    assert memory_wall.step_bytes(prof, 10) == prof["weights"] + 5 * 64 * 4 + 64 * 11
    # steps after a 3-token prompt feed positions 3 and 4: 4 keys in window layers, 4 and 5 in the global
    assert memory_wall.decode_bytes(prof, 3, 2) == prof["weights"] + 5 * 64 * 4 + 64 * 4.5
    gbps = 2.0
    pct = memory_wall.share_of_wall(prof, 3, 2, tok_s=1000.0, gbps=gbps)
    assert pct == pytest.approx(100 * (prof["weights"] + 1568) * 1000 / 2e9)
    with pytest.raises(ValueError, match="position"):
        memory_wall.step_bytes(prof, -1)


def test_an_output_matrix_replaces_the_tied_read(tmp_path):
    import gguf
    out = gguf.quants.quantize(np.ones((VOCAB, D), np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = write_tiny_gguf(tmp_path / "l.gguf", arch="llama", n_layers=2, d_model=D, n_heads=4, n_kv_heads=1,
                           head_dim=16, d_ff=FF, vocab=VOCAB, extra_tensors={"output.weight": (out, "Q8_0")})
    prof = memory_wall.profile(path)
    layer = (D + D) * F32 + (Q * D + 2 * KV * D + D * Q) * F32 + 3 * FF * D * F32
    assert not prof["tied"] and prof["weights"] == 2 * layer + D * F32 + VOCAB * D * Q8_0 + D * F32
    assert prof["windows"] == [None, None]
