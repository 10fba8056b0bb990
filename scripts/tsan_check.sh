#!/usr/bin/env bash
# ThreadSanitizer run of the CUDA emulation harness (one decode and one prefill launch), standalone.
# The same check runs in the test suite (tests/test_gpu_emu_checks.py::test_tsan_clean); this script is
# for looking at a report by hand. Needs g++ with -fsanitize=thread (libtsan).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-$(mktemp -d)}"
PYTHONPATH="$PWD:$PWD/tests" python - "$dir" <<'PY'
import sys
from pathlib import Path
from cuda_emu import emu
print(emu.build_tsan_program(Path(sys.argv[1])))
PY
"$dir/tsan_check"
echo "tsan_check: no ThreadSanitizer report"
