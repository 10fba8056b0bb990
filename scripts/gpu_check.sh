#!/usr/bin/env bash
# GPU check: the oracle tests through real CuPy, then the decode bandwidth benchmark (table + JSON):
# float16, bfloat16, q8_0 and q4_0 K/V, each kind's tok/s against float16's in the same run.
# For a machine with an NVIDIA GPU and CuPy (+ pytest) preinstalled: no network, no pip installs,
# nothing but this repository's files. The two steps stop at 200 s and 300 s (not yet run on a device).
#   bash scripts/gpu_check.sh            # results in out/gpu_decode.json
#   OUT=/some/dir bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
start=$(date +%s)

python - <<'PY'
import sys
from streamattn.backends import gpu
if not gpu.available():
    sys.exit("gpu_check: CuPy sees no CUDA device (or CuPy is missing); nothing to check here")
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
print("gpu_check:", props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
      "| CuPy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
PY
python -c "import pytest" 2>/dev/null || { echo "gpu_check: pytest is not installed here" >&2; exit 2; }

# 1. correctness on the device: the emulated oracle tests again (quantized K/V included), plus long caches
#    with default splits
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_device.py \
    --junitxml "$OUT/gpu_tests.xml"

# 2. bandwidth: decode vs a D2D copy measured in the same run
timeout 300 python benchmarks/gpu_decode.py --json "$OUT/gpu_decode.json" | tee "$OUT/gpu_decode.txt"

echo "gpu_check: done in $(( $(date +%s) - start )) s; results in $OUT/"
