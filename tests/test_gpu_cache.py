"""The GPU cache's device append, device counters and one finite check a step, through the fake CuPy.

Runs tests/gpu_cache_cases.py in a subprocess with tests/fake_cupy first on the path (numpy arrays, the CUDA
kernels run by the CPU emulation), over a small emulation library: the append kernels and the attention
kernels the cases launch, and the layer kernels of the model case (GpuOps).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_emu import emu
from streamattn.kv.backends import gpu_source

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")


def test_gpu_cache_through_the_fake_cupy(tmp_path):
    tags = ("f32", "f16", "q8", "q4")
    specs = [gpu_source.spec_name(kind, 64, t) for kind in ("append", "decode", "prefill") for t in tags]
    specs += [gpu_source.spec_name(kind, 64, "q8", v_tag="f16") for kind in ("append", "decode", "prefill")]
    specs += [gpu_source.spec_name("merge", 64)] + list(gpu_source.LAYER_SPECS)   # a model's steps: GpuOps' kernels
    kinds = ("append", "decode", "prefill", "merge", "layer")
    lib = emu.build(tmp_path, sources={k: gpu_source.source(k) for k in kinds}, specs=specs)
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(lib), PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/gpu_cache_cases.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout and "skipped" not in done.stdout
    assert "18 passed" in done.stdout
