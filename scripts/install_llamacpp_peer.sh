#!/usr/bin/env bash
# Install llama.cpp as a benchmark peer: the npm package node-llama-cpp, pinned, with its prebuilt CPU
# binaries for linux-x64 only (nothing is compiled; the CUDA/Vulkan builds are not fetched).
# Target: ./.peer/llamacpp beside the project (git-ignored). Used by benchmarks/peer_llamacpp.py only;
# never by the tests (CI needs no node).
#
#   bash scripts/install_llamacpp_peer.sh            # -> .peer/llamacpp/node_modules/node-llama-cpp
set -euo pipefail
VERSION="${NODE_LLAMA_CPP_VERSION:-3.22.1}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.peer/llamacpp"
command -v npm >/dev/null || { echo "install_llamacpp_peer: npm not found (apt-get install nodejs npm; node >= 20)" >&2; exit 1; }
mkdir -p "$DEST"
cd "$DEST"
[ -f package.json ] || echo '{"name": "streamattn-llamacpp-peer", "private": true, "type": "module"}' > package.json
# --omit=optional skips the GPU prebuilds; the CPU prebuild is then named explicitly.
# NODE_LLAMA_CPP_SKIP_DOWNLOAD: never fetch llama.cpp sources or build at install time.
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund --omit=optional \
  "node-llama-cpp@$VERSION" "@node-llama-cpp/linux-x64@$VERSION"
node -e 'import("node-llama-cpp").then(async m => {
  const llama = await m.getLlama({gpu: false, build: "never"});
  console.log(`node-llama-cpp ready: llama.cpp ${llama.llamaCppRelease.release}, gpu ${llama.gpu}`);
  await llama.dispose();
})'
