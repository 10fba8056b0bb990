"""Importing streamattn sets the thread runtimes' wait policy before they load, and it reaches them."""

import json
import os
import subprocess
import sys

import pytest

from streamattn.threads import REPORTED, RUNTIME_ENV, runtime_report, set_threads

_PROBE = """
import streamattn                                          # first, as the CLI does
import json, numpy as np
from streamattn.bench.ceiling import _parallel_sum       # a cached parallel kernel: no compile here
from streamattn.threads import runtime_report
_parallel_sum(np.ones(64, np.float32), 2, 1)
print(json.dumps(runtime_report()))
"""


def _run(extra_env: dict) -> tuple:
    env = {k: v for k, v in os.environ.items() if k not in REPORTED}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra_env)     # libgomp prints its settings as it loads
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the omp layer and /proc are Linux's")
def test_wait_policy_reaches_the_openmp_runtime():
    report, omp = _run({})
    assert f"GOMP_SPINCOUNT = '{RUNTIME_ENV['GOMP_SPINCOUNT']}'" in omp      # libgomp's own view
    assert report["threading_layer"] == "omp"
    assert report["env"] == {"OMP_WAIT_POLICY": None, **RUNTIME_ENV} and report["user_set"] == {}
    assert report["late"] == {"openblas": False, "libgomp": False}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the omp layer and /proc are Linux's")
def test_an_exported_value_wins():
    """The same check tells the policies apart: a user's ACTIVE keeps libgomp's own (long) spin, not ours,
    and a user's GOMP_SPINCOUNT replaces ours."""
    report, omp = _run({"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in omp and "GOMP_SPINCOUNT = '30000000000'" in omp
    assert report["user_set"] == {"OMP_WAIT_POLICY": "ACTIVE"} and report["env"]["OMP_WAIT_POLICY"] == "ACTIVE"
    assert report["env"]["GOMP_SPINCOUNT"] is None
    report, omp = _run({"GOMP_SPINCOUNT": "0"})
    assert "GOMP_SPINCOUNT = '0'" in omp and report["user_set"] == {"GOMP_SPINCOUNT": "0"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_numpy_imported_first_is_reported_late():
    p = subprocess.run([sys.executable, "-c", "import numpy, json, streamattn.threads as t; "
                        "print(json.dumps(t.runtime_report()['late']))"], capture_output=True, text=True, timeout=300)
    assert json.loads(p.stdout) == {"openblas": True, "libgomp": False}, p.stderr[-2000:]


def test_set_threads_validates():
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        set_threads(0)
    assert runtime_report()["env"]["OPENBLAS_THREAD_TIMEOUT"] == os.environ.get("OPENBLAS_THREAD_TIMEOUT")
