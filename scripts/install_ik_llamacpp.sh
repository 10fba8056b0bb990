#!/usr/bin/env bash
# Build ik_llama.cpp's llama-bench as a benchmark peer (benchmarks/peer_llamacpp.py --peers ik_llama.cpp).
# ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp) is a llama.cpp fork with its own x86 matrix kernels
# (ggml/src/iqk/) and run-time repacking of weights (llama-bench -rtr 1). It has no prebuilt binaries on
# PyPI or npm, so it is compiled here: CPU only, -DGGML_NATIVE=ON (-march=native: tuned to the CPU that
# builds it, which is the CPU the benchmark runs on; a build with explicit AVX-512 flags failed to
# compile before), Release, only the llama-bench target, static libraries (one binary, no rpath).
#
#   bash scripts/install_ik_llamacpp.sh                     # sources: the ik-llama-cpp-python sdist on PyPI
#   bash scripts/install_ik_llamacpp.sh SRC                 # sources: an ik_llama.cpp tree or tarball
#   -> <peer home>/ik_llamacpp/build/bin/llama-bench, and <peer home>/ik_llamacpp/status.json
#
# SRC is a directory holding ik_llama.cpp's top-level CMakeLists.txt, or a .tar/.tar.gz of one (one
# top-level folder or none). To build a given commit of the upstream repository without a network
# clone, make a tarball of it anywhere git can reach it, e.g. from a clone or bare mirror:
#     git --git-dir=ik_llama.cpp/.git archive --format=tar HEAD > ik.tar      # then: ... install_ik_llamacpp.sh ik.tar
# (the tarball carries its commit id, which status.json records; a mirror that lacks some large blobs can
# leave them out with pathspecs such as ':(exclude)models/*.gguf' - llama-bench needs none of them).
# Without SRC the sources come from the sdist of the PyPI package ik-llama-cpp-python (IK_PY_VERSION,
# default 0.1.5), which vendors a full ik_llama.cpp tree under vendor/ik_llama.cpp; pip fetches it by
# name with --no-binary, so nothing is compiled by pip.
#
# The peer home is streamattn/bench/peer_home.py's: this checkout's .peer/, or from a git worktree its main
# checkout's when that exists (git-ignored). Used by benchmarks only, never by the tests.
#
# Environment: JOBS (parallel compile jobs, default 2), NICE (default 19), IK_PY_VERSION, GGUF (model for
# the check run after the build; none: only --help), REBUILD=1 (configure and build again even when the
# binary exists). The script is idempotent: with the binary present it only runs the check.
set -euo pipefail

JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
IK_PY_VERSION="${IK_PY_VERSION:-0.1.5}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="$(cd "$ROOT" && python3 -c 'import sys; sys.path.insert(0, "streamattn/bench")
from peer_home import peer_home; print(peer_home())')"
DEST="$HOME_DIR/ik_llamacpp"
SRC_DIR="$DEST/src"
BUILD="$DEST/build"
BIN="$BUILD/bin/llama-bench"
STATUS="$DEST/status.json"

say() { printf '[install_ik_llamacpp %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { say "ERROR: $*" >&2; exit 1; }

command -v cmake >/dev/null || die "cmake not found (apt-get install cmake build-essential)"
command -v c++ >/dev/null || die "no C++ compiler (apt-get install build-essential)"
mkdir -p "$DEST"

# ------------------------------------------------------------------ sources -> $SRC_DIR, $ORIGIN
unpack() {  # $1 = tarball; unpack into $SRC_DIR whether it holds one top folder or the tree itself
  rm -rf "$SRC_DIR" "$SRC_DIR.tmp"; mkdir -p "$SRC_DIR.tmp"
  tar -xf "$1" -C "$SRC_DIR.tmp"
  local top="$SRC_DIR.tmp"
  [ -f "$top/CMakeLists.txt" ] || top="$(find "$SRC_DIR.tmp" -mindepth 2 -maxdepth 2 -name CMakeLists.txt -printf '%h\n' | head -1)"
  [ -n "$top" ] && [ -f "$top/CMakeLists.txt" ] || die "no CMakeLists.txt at the top of $1 or of its one folder"
  if [ "$top" = "$SRC_DIR.tmp" ]; then mv "$top" "$SRC_DIR"; else mv "$top" "$SRC_DIR"; rm -rf "$SRC_DIR.tmp"; fi
}

ORIGIN=""
if [ -n "${1:-}" ]; then
  if [ -d "$1" ]; then
    [ -f "$1/CMakeLists.txt" ] && [ -f "$1/examples/llama-bench/llama-bench.cpp" ] \
      || die "$1 is not an ik_llama.cpp tree (expected CMakeLists.txt and examples/llama-bench/llama-bench.cpp)"
    SRC_DIR="$(cd "$1" && pwd)"
    ORIGIN="directory $SRC_DIR$(git -C "$SRC_DIR" rev-parse HEAD 2>/dev/null | sed 's/^/, commit /' || true)"
  elif [ -f "$1" ]; then
    say "unpacking $1 into $SRC_DIR"
    unpack "$1"
    commit="$( (gzip -dc "$1" 2>/dev/null || cat "$1") | git get-tar-commit-id 2>/dev/null || true)"
    ORIGIN="tarball $(basename "$1")${commit:+, commit $commit}"
  else
    die "$1: no such directory or tarball (give an ik_llama.cpp source tree or a tar of one)"
  fi
else
  SDIST="$DEST/sdist/ik_llama_cpp_python-$IK_PY_VERSION.tar.gz"
  if [ ! -f "$SRC_DIR/.from-ik-llama-cpp-python-$IK_PY_VERSION" ]; then
    if [ ! -f "$SDIST" ]; then
      say "downloading the ik-llama-cpp-python $IK_PY_VERSION sdist with pip (sources only, no dependencies)"
      python3 -m pip download --no-deps --no-binary :all: "ik-llama-cpp-python==$IK_PY_VERSION" -d "$DEST/sdist"
    fi
    [ -f "$SDIST" ] || die "pip did not leave $SDIST"
    say "unpacking vendor/ik_llama.cpp from $(basename "$SDIST")"
    rm -rf "$SRC_DIR"; mkdir -p "$SRC_DIR"
    tar -xzf "$SDIST" -C "$SRC_DIR" --strip-components=3 "ik_llama_cpp_python-$IK_PY_VERSION/vendor/ik_llama.cpp"
    touch "$SRC_DIR/.from-ik-llama-cpp-python-$IK_PY_VERSION"
  fi
  ORIGIN="PyPI sdist ik-llama-cpp-python $IK_PY_VERSION (vendor/ik_llama.cpp)"
fi
[ -f "$SRC_DIR/examples/llama-bench/llama-bench.cpp" ] || die "no examples/llama-bench in $SRC_DIR"
# ik_llama.cpp's cmake/build-info.cmake asks git for the commit from the source folder; unpacked into the
# peer home, which lies inside this checkout, git would answer with this checkout's commit. The ceiling
# stops git above the source folder: a tree with its own .git still reports it, a tarball "unknown" (the
# commit a tarball carries is in status.json).
export GIT_CEILING_DIRECTORIES="$(dirname "$SRC_DIR")"

# ------------------------------------------------------------------ build
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_CCACHE=OFF
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF
  # FlashAttention kernels for q4_0/q4_1/iq4_nl K/V caches: not used (the benchmark keeps float16 K/V, the
  # default) and a large share of the compile (ggml/CMakeLists.txt: GGML_IQK_FA_ALL_QUANTS)
  -DGGML_IQK_FA_ALL_QUANTS=OFF
  --no-warn-unused-cli
)
BUILD_S=""
if [ -x "$BIN" ] && [ -z "${REBUILD:-}" ]; then
  say "llama-bench exists ($BIN): skipping the build (REBUILD=1 to build again)"
  BUILD_S="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("build_s") or "")' "$STATUS" 2>/dev/null || true)"
  ORIGIN="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("source") or "")' "$STATUS" 2>/dev/null || echo "$ORIGIN")"
else
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  rm -rf "$BUILD"
  say "configuring $BUILD from $ORIGIN"
  nice -n "$NICE" cmake -S "$SRC_DIR" -B "$BUILD" "${gen[@]}" "${FLAGS[@]}" > "$DEST/configure.log" 2>&1 \
    || { tail -30 "$DEST/configure.log" >&2; die "cmake configure failed (log: $DEST/configure.log)"; }
  say "compiling llama-bench with -j$JOBS at nice $NICE (log: $DEST/build.log); tens of minutes on 2 cores"
  t0=$SECONDS
  nice -n "$NICE" cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-bench > "$DEST/build.log" 2>&1 &
  pid=$! next=120
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    if [ $(( SECONDS - t0 )) -ge "$next" ]; then
      say "  ... $(( (SECONDS - t0) / 60 )) min: $(grep -Eo '^\[[ 0-9/%]+\]' "$DEST/build.log" | tail -1 || true)"
      next=$(( next + 120 ))
    fi
  done
  wait "$pid" || { tail -40 "$DEST/build.log" >&2; die "build failed (log: $DEST/build.log)"; }
  BUILD_S=$(( SECONDS - t0 ))
  [ -x "$BIN" ] || die "the build finished without $BIN"
  say "built in ${BUILD_S} s"
fi

# ------------------------------------------------------------------ check
set +e
if [ -n "${GGUF:-}" ] && [ -f "$GGUF" ]; then
  say "check run: llama-bench -m $GGUF -rtr 1 -p 16 -n 8 -t 1 -r 1 -o json"
  "$BIN" -m "$GGUF" -rtr 1 -p 16 -n 8 -t 1 -r 1 -o json > "$DEST/check.json" 2> "$DEST/check.log"
  rc=$?
else
  say "no GGUF for a check run (set GGUF=...): only --help"
  "$BIN" --help > "$DEST/check.log" 2>&1
  rc=$?
fi
set -e
[ "$rc" -eq 0 ] || { tail -20 "$DEST/check.log" >&2; die "the check run failed with exit $rc (log: $DEST/check.log)"; }
cat > "$STATUS" <<EOF
{"bin": "$BIN", "source": "$ORIGIN", "build_s": ${BUILD_S:-null}, "cmake_flags": "$(printf '%s ' "${FLAGS[@]}" | sed 's/ $//')",
 "compiler": "$(c++ --version | head -1 | sed 's/"/\\"/g')", "host_flags": "$(grep -o 'avx512[a-z_]*\|avx2\|amx[a-z_]*' /proc/cpuinfo | sort -u | paste -sd' ' -)"}
EOF
say "status: $(tr -d '\n' < "$STATUS")"
say "llama-bench: $BIN"
