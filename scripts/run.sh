#!/usr/bin/env bash
# The main job on a fresh machine: install, then stream a completion from SmolLM2-135M with its default
# (full causal) cache. Arguments go to `streamattn generate` (default: a chat prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- "Explain in three sentences why the sky is blue." --chat -n 96 --stats
fi
exec "${PYTHON:-python3}" -m streamattn.cli generate "$@"
