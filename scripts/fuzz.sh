#!/usr/bin/env bash
# The fuzzers with more examples than CI and fresh random seeds:
#   1. the cache-state machine (CI: 150 derandomised examples);
#   2. the two file readers an attacker controls, snapshot .npz and GGUF (tests/fuzz_readers.py; CI: 120
#      derandomised examples each), under an address-space cap and a per-case time bound.
#   bash scripts/fuzz.sh                  # 2000 examples of up to 30 steps; 2000 mutated files per reader
#   bash scripts/fuzz.sh 20000 60         # examples, steps per example
#   STREAMATTN_FUZZ_EXAMPLES=500 bash scripts/fuzz.sh
# Extra arguments after the two numbers go to pytest (e.g. --hypothesis-seed=7). State-machine failures are
# saved in .hypothesis/ and replayed first on the next run; hypothesis prints the failing rule sequence or
# the shrunk file mutation. Reader runs print their seed, to replay with
#   python3 tests/fuzz_readers.py --examples N --seed SEED
set -euo pipefail
cd "$(dirname "$0")/.."
export STREAMATTN_FUZZ_EXAMPLES="${1:-${STREAMATTN_FUZZ_EXAMPLES:-2000}}"
export STREAMATTN_FUZZ_STEPS="${2:-${STREAMATTN_FUZZ_STEPS:-30}}"
shift $(( $# < 2 ? $# : 2 ))
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -m pytest tests/test_state_fuzz.py -k "test_state_machine" -x -q "$@"
SEED=${STREAMATTN_FUZZ_SEED:-$RANDOM$RANDOM}
echo "reader fuzz: seed $SEED"
PYTHONWARNINGS=ignore exec "$PY" tests/fuzz_readers.py --examples "$STREAMATTN_FUZZ_EXAMPLES" --seed "$SEED"
