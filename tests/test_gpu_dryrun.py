"""Dry runs of the GPU-only code (gpu.py, test_gpu_device.py, benchmarks/gpu_decode.py) without a GPU.

tests/fake_cupy stands in for CuPy (numpy arrays, kernels launched in the CPU emulation), so a typo in
a CuPy call, a wrong argument or a broken test wiring shows up here, not first on a lent GPU machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_emu import emu
from streamattn.kv.reference import TOLERANCE
from gpu_fixtures import emu_library  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")


@pytest.fixture(scope="module")
def fake_env(emu_library):
    env = dict(os.environ)
    env.update(STREAMATTN_FAKE_CUPY_LIB=str(emu_library), PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    return env


def test_device_tests_run_through_the_fake(fake_env):
    selection = ("sinks-bfloat16-128 or window-float16-64 or public or float16_queries or gqa_groups or float16_sinks "
                 "or every_width_agrees or Q6_K-5-2-3 or (soft_capped and causal-float16) or 64-neox-True "
                 "or residual_add or glu_matches")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           "tests/test_gpu_device.py", "-k", selection], cwd=ROOT, env=fake_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def test_benchmark_runs_through_the_fake(fake_env, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_decode.py", "--lengths", "520", "--batches", "1",
                           "--heads", "4/1", "--head-dim", "64", "--launches", "2", "--copy-bytes", "65536",
                           "--json", str(out)], cwd=ROOT, env=fake_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["dtype"] for r in result["rows"]] == ["float16", "bfloat16", "q8_0", "q4_0"]
    assert all(r["splits"] == 2 and r["error"] < TOLERANCE["float16"] for r in result["rows"])   # out: float16
    rows = {r["dtype"]: r for r in result["rows"]}
    assert rows["q8_0"]["bytes"] * 64 == rows["float16"]["bytes"] * 34    # 2 x 34-byte blocks against 128 bytes
    assert rows["q4_0"]["bytes"] * 64 == rows["float16"]["bytes"] * 18
    assert all(r["vs_float16"] > 0 for r in result["rows"] if r["dtype"] != "float16")
    assert "% copy" in done.stdout and "tok/s against float16" in done.stdout


def test_gpu_check_keeps_going_and_writes_one_summary(tmp_path):
    """scripts/gpu_check.sh on the fake device with every step failing (a `timeout` on PATH that exits 3 at
    once): all four steps still run, each is recorded FAILED in the one summary file, and the script exits 1."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "timeout").write_text("#!/bin/sh\necho \"ran: $*\"\nexit 3\n")
    (shim / "timeout").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               PYTHONPATH=str(ROOT / "tests" / "fake_cupy"))
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    for ran in ("ran: 80 python -m pytest", "ran: 140 python benchmarks/gpu_model.py --json",
                "ran: 20 python benchmarks/gpu_model.py --graphs", "ran: 60 python benchmarks/gpu_decode.py"):
        assert ran in done.stdout, done.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("device: fake GPU")
    assert summary[1].startswith("oracle tests (tests/test_gpu_device.py): FAILED (exit 3)")
    assert summary[2].startswith("model (benchmarks/gpu_model.py): FAILED (exit 3)")
    assert summary[3].startswith("model with CUDA graphs (benchmarks/gpu_model.py --graphs): FAILED (exit 3)")
    assert summary[4].startswith("decode benchmark (benchmarks/gpu_decode.py): FAILED (exit 3)")
    assert summary[5].endswith("some step FAILED")
