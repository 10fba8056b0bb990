"""Proof that the GPU-on-CPU checks can see errors: planted bugs, a deadlock, races under ThreadSanitizer.

Each test edits the loader's exact source text (the text NVRTC compiles) and shows the check fails;
the unedited text passes the same check (test_gpu_emu.py, and the clean TSan run below).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpu_oracle as go
from cuda_emu import emu
from gpu_fixtures import runner  # noqa: F401  (fixture)
from streamattn.kv.backends import gpu_source

pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")


def planted(kind: str, old: str, new: str) -> dict[str, str]:
    """The loader's sources with ``old`` replaced by ``new`` in ``kind`` (``old`` must occur once)."""
    sources = {k: gpu_source.source(k) for k in gpu_source.SOURCES}
    assert sources[kind].count(old) == 1, f"planted-bug anchor not found once in {kind}: {old!r}"
    sources[kind] = sources[kind].replace(old, new)
    return sources


def worst_error(emulator, *, T, window, sinks, dtype="float32", splits=2) -> float:
    rng = np.random.default_rng(3)
    lengths = [29, 17] if T == 1 else [29, 4]
    c = go.case(rng, batch=2, q_heads=4, kv_heads=2, head_dim=64, lengths=lengths, counts=[T, T], T=T,
                window=window, sinks=sinks, dtype=dtype)
    out, lse = emulator.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=window, sinks=sinks,
                               scale=c["scale"], splits=splits if T == 1 else None)
    return max(go.rel_err(out, c["ref_out"]), go.lse_err(lse, c["ref_lse"]))


BUGS = {  # name -> (kernel kind, exact text, planted text, launch: T, window, sinks)
    "ring wrap off by one": ("decode", "return sinks + (pos - sinks) % (slots - sinks);",
                             "return sinks + (pos - sinks) % (slots - sinks - 1);", (1, 5, 2)),
    "shortened row reduction": ("decode", "for (int off = R::TPR / 2; off > 0; off >>= 1) s +=",
                                "for (int off = R::TPR / 2; off > 1; off >>= 1) s +=", (1, 0, 0)),
    "window counts one key too many": ("prefill", "pos > qpos - window", "pos >= qpos - window", (4, 5, 0)),
    "shortened warp sum": ("prefill", "for (int off = 16; off > 0; off >>= 1) x +=",
                           "for (int off = 8; off > 0; off >>= 1) x +=", (4, 0, 0)),
    "merge drops the last split": ("merge", "for (int s = 0; s < splits; ++s) {",
                                   "for (int s = 0; s < splits - 1; ++s) {", (1, 0, 0)),
}


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_caught(tmp_path, runner, bug):
    kind, old, new, (T, window, sinks) = BUGS[bug]
    specs = ["decode_f32_hd64", "merge_hd64", "prefill_f32_hd64"]
    assert worst_error(runner, T=T, window=window, sinks=sinks) <= go.TOL["float32"]  # the unplanted text
    broken = emu.Emulator(emu.build(tmp_path / "broken", sources=planted(kind, old, new), specs=specs),
                          timeout_s=20)
    assert worst_error(broken, T=T, window=window, sinks=sinks) > 100 * go.TOL["float32"]


def test_watchdog_reports_a_deadlock(tmp_path):
    """A __syncthreads that only some threads reach must end in an error, not a hung test run."""
    sources = planted("merge", "const long long row = blockIdx.x;",
                      "const long long row = blockIdx.x;\n    if (threadIdx.x == 0) __syncthreads();")
    lib = emu.build(tmp_path, sources=sources, specs=["merge_hd64"])
    # In a child process: the stuck threads stay blocked there, not in this test run.
    script = textwrap.dedent(f"""
        import numpy as np
        from cuda_emu import emu
        e = emu.Emulator({str(lib)!r}, timeout_s=3.0)
        part = np.zeros((1, 2, 64), np.float32); plse = np.zeros((1, 2), np.float32)
        out = np.zeros((1, 64), np.float32); lse = np.zeros(1, np.float32)
        try:
            e.launch("merge_hd64", (1, 1, 1), (64, 1, 1), [part, plse, out, lse, np.int32(2)])
        except RuntimeError as err:
            print("caught:", err)
        """)
    tests_dir = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": f"{tests_dir}:{tests_dir.parent}", "PATH": "/usr/bin:/bin"})
    assert "caught:" in done.stdout and "deadlock" in done.stdout, done.stdout + done.stderr


def run_tsan(tmp_path, sources=None) -> subprocess.CompletedProcess:
    exe = emu.build_tsan_program(tmp_path, sources=sources)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)


def test_tsan_clean(tmp_path):
    """One decode and one prefill launch under ThreadSanitizer: no report."""
    done = run_tsan(tmp_path)
    assert done.returncode == 0 and "ThreadSanitizer" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("kind,anchor", [("decode", "    __syncthreads();\n    for (int idx"),
                                          ("prefill", "        __syncthreads();\n#pragma unroll")])
def test_tsan_sees_a_missing_barrier(tmp_path, kind, anchor):
    done = run_tsan(tmp_path, planted(kind, anchor, anchor.replace("__syncthreads();", "")))
    assert "ThreadSanitizer: data race" in done.stderr
