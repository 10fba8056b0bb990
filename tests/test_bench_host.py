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


def _on_cpu_s(pid: int) -> float:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9     # ns on a CPU, exact


def test_noise_keeps_its_duty_and_is_reaped():
    """Its CPU time against a 100% neighbour's over the same second: half, in a generous band. A ratio,
    not CPU / wall, because this host is shared (and the tests run niced): under load a neighbour at
    100% gets a fraction of a core too, so only the two side by side say what the duty did."""
    with Noise(0.5, period_ms=10) as half, Noise(1.0) as full:
        time.sleep(0.3)                                       # past both interpreters' start
        start = _on_cpu_s(half.proc.pid), _on_cpu_s(full.proc.pid)
        time.sleep(1.0)
        ratio = (_on_cpu_s(half.proc.pid) - start[0]) / (_on_cpu_s(full.proc.pid) - start[1])
        pids = half.proc.pid, full.proc.pid
    assert all(_gone(pid) for pid in pids) and half.proc is None and full.proc is None
    assert 0.2 < ratio < 0.9, ratio
    assert 0 < half.cpu_s < half.wall_s                       # reaped with its CPU time read


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


def test_peer_home_of_a_checkout_and_of_its_worktree(tmp_path):
    main, wt = tmp_path / "main", tmp_path / "wt"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(main)], check=True)
    subprocess.run([*git, "-C", str(main), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    subprocess.run([*git, "-C", str(main), "worktree", "add", "-q", str(wt), "-b", "wt"], check=True)
    assert peer_home(wt) == wt / ".peer"                     # nowhere installed: the worktree's own (absent)
    (main / ".peer").mkdir()
    assert peer_home(main) == main / ".peer" and peer_home(wt) == main / ".peer"
    (wt / ".peer").mkdir()
    assert peer_home(wt) == wt / ".peer"                     # its own install wins
    assert peer_home(tmp_path / "nowhere") == tmp_path / "nowhere" / ".peer"


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
