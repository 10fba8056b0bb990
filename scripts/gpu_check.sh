#!/usr/bin/env bash
# GPU check: the oracle tests through real CuPy (attention, soft-capped attention and the packed gemv), then
# a whole model (benchmarks/gpu_model.py: a packed model's logits and 32 greedy ids against the CPU float32
# path, then decode tok/s and % of the copy bandwidth at Llama-3.2-1B and 3.1-8B Q4_K_M shapes, batch 1 and
# 16, fixtures written on the machine), then the attention decode benchmark (table + JSON): float16,
# bfloat16, q8_0 and q4_0 K/V at 4k and 32k, each kind's tok/s against float16's in the same run.
# For a machine with an NVIDIA GPU and CuPy, pytest and hypothesis preinstalled: no network, no pip installs,
# nothing but this repository's files. Every step runs even when one before it failed; each step's exit
# status and time go to one summary file (with the model steps' figures: the check's line, the copy
# bandwidth, each decode row), and the script exits non-zero when any step failed. The four steps stop at
# 80 s, 140 s, 20 s and 60 s, 5 minutes in all (not yet run on a device).
#   bash scripts/gpu_check.sh            # results in out/: summary.txt, gpu_tests.xml, gpu_model.json,
#                                        # gpu_decode.json
#   OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
start=$(date +%s)
failed=0
: > "$SUMMARY"

note() { echo "gpu_check: $*"; echo "$*" >> "$SUMMARY"; }

# step NAME COMMAND...: run it, record "NAME: ok|FAILED (exit N), S s" in the summary, keep going
step() {
    local name=$1 t0=$(date +%s) rc
    shift
    "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then note "$name: ok, $(( $(date +%s) - t0 )) s"
    else note "$name: FAILED (exit $rc), $(( $(date +%s) - t0 )) s"; failed=1; fi
}

python - <<'PY' 2>&1 | tee -a "$SUMMARY"
import sys
from streamattn.kv.backends import gpu
if not gpu.available():
    sys.exit("device: none (CuPy sees no CUDA device, or CuPy is missing); nothing to check here")
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
print("device:", props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
      "| CuPy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: summary in $SUMMARY" >&2; exit 2; }

missing=""
for module in pytest hypothesis; do   # the oracle tests import hypothesis (tests/test_gpu_emu.py's property test)
    python -c "import $module" 2>/dev/null || missing="$missing $module"
done

# 1. correctness on the device: the emulated oracle tests again (quantized K/V, soft-capping and the packed
#    gemv included), plus long caches with default splits
if [ -z "$missing" ]; then
    step "oracle tests (tests/test_gpu_device.py)" timeout 80 python -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_gpu_device.py --junitxml "$OUT/gpu_tests.xml"
else
    note "oracle tests: FAILED (not run: missing Python modules:$missing)"
    failed=1
fi

# 2. a whole model: equal to the CPU path, then its decode speed at 1B and 8B shapes
model() { timeout 140 python benchmarks/gpu_model.py --json "$OUT/gpu_model.json" | tee "$OUT/gpu_model.txt"; }
step "model (benchmarks/gpu_model.py)" model
figures() { grep -sE '^(check:|device-to-device copy:)|% of copy$' "$1" | sed 's/^/    /' >> "$SUMMARY"; }
figures "$OUT/gpu_model.txt"

# 2b. the same check with the decode steps' layer work as CUDA graphs (off by default until this passes)
graphs() { timeout 20 python benchmarks/gpu_model.py --graphs --skip-speed --json "$OUT/gpu_model_graphs.json" \
           | tee "$OUT/gpu_model_graphs.txt"; }
step "model with CUDA graphs (benchmarks/gpu_model.py --graphs)" graphs
figures "$OUT/gpu_model_graphs.txt"

# 3. attention bandwidth: decode vs a D2D copy measured in the same run
bench() { timeout 60 python benchmarks/gpu_decode.py --lengths 4096 32768 --json "$OUT/gpu_decode.json" \
          | tee "$OUT/gpu_decode.txt"; }
step "decode benchmark (benchmarks/gpu_decode.py)" bench

note "total: $(( $(date +%s) - start )) s; $([ "$failed" -eq 0 ] && echo "all steps ok" || echo "some step FAILED")"
echo "gpu_check: summary in $SUMMARY; results in $OUT/"
exit "$failed"
