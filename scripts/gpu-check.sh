#!/usr/bin/env bash
# The CUDA backend's checks on a machine with NVIDIA GPUs, in two halves:
#
#   scripts/gpu-check.sh build         # here, with cargo: release binaries, stripped,
#                                      # into target/gpu-check/ (about 30 MiB)
#   scripts/gpu-check.sh run [OUTDIR]  # on the GPU machine, from the repository's
#                                      # root, with target/gpu-check/ brought along
#
# The GPU machine needs a CUDA 13 driver (R580 or newer), libnvrtc, libcublas(Lt) and, for
# the NCCL checks, libnccl: a CUDA toolkit or PyTorch's nvidia-* wheels have them,
# and `run` finds them. It needs no Rust, no network, and the repository's
# tests/fixtures. It runs in under 10 minutes on one H200 (each step has a
# timeout) and writes every step's log and a summary to OUTDIR
# (default: gpu-check-out). Exit status: 0 when every step passed.
#
# Steps of `run`:
#   0. versions  driver, NVRTC, cuBLAS, NCCL and the wheels (pip show); the
#                disk's fsynced write bandwidth;
#   1. kernels   every kernel compiles with the machine's NVRTC (sm_80, sm_90),
#                to cubins;
#   2. parity    every parity fixture through the CUDA backend: f32 against the
#                reference backend at 1e-4, bf16 against PyTorch bf16's error;
#                chunked prefill; batch invariance measured; NCCL at world size
#                1; --tp 2 when there are two GPUs; the kernel image (cubin)
#                and the MoE GEMM path; bf16 attention at head dims 64-256;
#   3. cli       `strata extract --backend cuda` on the embedded model and on a
#                fixture, then `strata verify --recompute` on the GPU;
#   4. bench     Llama-3-8B shape: tokens/s, MFU, capture+writer overhead;
#                DeepSeek-V3-shaped MoE: tokens/s.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check

build() {
  set -e
  # The release profile (not bench's) for every binary; JSON names the test and bench executables.
  local json
  json=$(cargo build --release --features cuda --bin strata --test integration --bench gpu \
    --message-format=json-render-diagnostics)
  rm -rf "$BIN" && mkdir -p "$BIN"
  cp target/release/strata "$BIN/strata"
  for t in integration gpu; do
    local exe
    exe=$(printf '%s\n' "$json" | grep "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    [ -n "$exe" ] || { echo "no executable for $t in cargo's output" >&2; exit 1; }
    cp "$exe" "$BIN/$t"
  done
  mv "$BIN/gpu" "$BIN/gpu-bench"
  strip "$BIN"/*
  du -b "$BIN"/* | awk '{s += $1; printf "  %-28s %6.1f MiB\n", $2, $1 / 1048576} END {printf "  total %.1f MiB\n", s / 1048576; if (s > 48 * 1048576) {print "over 48 MiB: with the tree (~15 MiB) it would not fit in 64" > "/dev/stderr"; exit 1}}'
  echo "bring $BIN/ along with the repository (tests/fixtures) and run: scripts/gpu-check.sh run"
}

# Puts NVRTC, cuBLAS and NCCL on LD_LIBRARY_PATH, under the names cudarc
# dlopens (it asks for libnccl.so, the wheel ships libnccl.so.2).
find_libs() {
  local links=/tmp/strata-cuda-libs dirs=() d
  mkdir -p "$links"
  # PyTorch's CUDA 13 wheels first (what the build's cuda-13000 expects), then the toolkit.
  local roots=()
  if command -v python3 >/dev/null; then
    while read -r d; do roots+=("$d"); done < <(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
found = set()
for p in set(site.getsitepackages() + [site.getusersitepackages()] + sys.path):
    found.update(glob.glob(os.path.join(p, "nvidia", "*", "lib")))
print("\n".join(sorted(found)))
EOF
)
  fi
  roots+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu)
  for lib in nvrtc cublas cublasLt nccl; do
    local found=""
    for r in "${roots[@]}"; do
      # The newest version in a folder (libcublas.so.13 over .so.12).
      found=$(ls "$r/lib$lib.so" "$r"/lib"$lib".so.[0-9]* 2>/dev/null | sort -V | tail -1)
      [ -n "$found" ] && break
    done
    if [ -z "$found" ]; then
      echo "  lib$lib: not found (looked in ${roots[*]})"
      continue
    fi
    echo "  lib$lib: $found"
    ln -sf "$found" "$links/lib$lib.so"
    dirs+=("$(dirname "$found")")
  done
  local path="$links"
  for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do path="$path:$d"; done
  export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

run() {
  local out=${1:-gpu-check-out}
  mkdir -p "$out"
  [ -x "$BIN/strata" ] || { echo "no $BIN/strata: run 'scripts/gpu-check.sh build' on a machine with cargo and bring $BIN/" >&2; exit 2; }
  [ -d tests/fixtures ] || { echo "run from the repository's root (tests/fixtures is missing)" >&2; exit 2; }
  if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no NVIDIA GPU here (no /dev/nvidia0, nvidia-smi finds none): run this on a GPU machine" >&2
    exit 2
  fi
  local start=$SECONDS summary="$out/summary.txt" failed=0
  : >"$summary"
  {
    echo "gpu-check $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
    echo "libraries:"
  } | tee -a "$summary"
  # In this shell, not a pipeline's subshell: its LD_LIBRARY_PATH must reach the steps.
  find_libs >"$out/libraries.txt"
  tee -a "$summary" <"$out/libraries.txt"
  echo "  LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$summary"
  {
    echo "wheels:"
    python3 -m pip show nvidia-cuda-nvrtc nvidia-cuda-nvrtc-cu12 nvidia-cublas nvidia-cublas-cu12 nvidia-nccl-cu13 \
      nvidia-nccl-cu12 torch 2>/dev/null | awk '/^Name:/ {n = $2} /^Version:/ {printf "  %s %s\n", n, $2}'
    echo "disk (fsynced write, 1 GiB, to this directory's filesystem):"
    dd if=/dev/zero of=gpu-check-dd.tmp bs=16M count=64 conv=fsync 2>&1 | tail -1 | sed 's/^/  /'
    rm -f gpu-check-dd.tmp
  } 2>&1 | tee -a "$summary"
  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || ngpu=0
  export STRATA_REQUIRE_GPU=1 STRATA_REQUIRE_NVRTC=1 STRATA_KERNEL_CACHE=/tmp/strata-kernel-cache RUST_BACKTRACE=1

  step() { # name timeout command...
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local verdict=passed
    if [ $rc -ne 0 ]; then
      failed=1
      verdict="FAILED (exit $rc)"
      if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="FAILED (timed out after $limit s)"; fi
    fi
    echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$summary"
    tail -n 40 "$out/$name.log"
  }

  # The integration tests' GPU suites (one binary holds every suite; a filter picks them).
  step kernels 45 "$BIN/integration" kernels:: --test-threads=1 --nocapture
  step parity 150 "$BIN/integration" cuda_gpu:: --test-threads=1 --nocapture
  grep -E '^(fixture|[a-z0-9-]+ +[0-9.e+-]+ )|alone vs packed|--tp 2|^CUDA libraries|^kernels loaded|^head dims' "$out/parity.log" >>"$summary"

  local tmp=/tmp/strata-gpu-check
  rm -rf "$tmp" && mkdir -p "$tmp"
  step cli 60 bash scripts/gpu-check.sh cli "$tmp" "$ngpu"
  step bench 290 "$BIN/gpu-bench" --dir "$tmp/bench" --runs 3 --steps 3
  grep -E '^\(|tokens/s|MFU|capture|loaded|wrote|TFLOP/s|GEMMs' "$out/bench.log" >>"$summary"
  rm -rf "$tmp"

  echo "total $((SECONDS - start)) s; $([ $failed -eq 0 ] && echo 'every step passed' || echo 'SOME STEP FAILED')" | tee -a "$summary"
  echo "--- summary ($summary)"
  cat "$summary"
  return $failed
}

# Step 3 of `run`: the CLI on the GPU. Arguments: a scratch directory, the number of GPUs.
cli() {
  set -e
  local tmp=$1 ngpu=$2
  "$BIN/strata" extract --backend cuda --out "$tmp/embedded"
  "$BIN/strata" extract --backend cuda --compute f32 --model tests/fixtures/qwen3 \
    --data tests/fixtures/qwen3/data.jsonl --max-batch-tokens 8 --out "$tmp/qwen3"
  "$BIN/strata" inspect "$tmp/qwen3"
  "$BIN/strata" verify "$tmp/qwen3" --recompute 3 --backend cuda
  if [ "$ngpu" -ge 2 ]; then
    "$BIN/strata" extract --backend cuda --tp 2 --devices 0,1 --compute f32 --model tests/fixtures/deepseek-v3 \
      --data tests/fixtures/deepseek-v3/data.jsonl --out "$tmp/tp2"
    "$BIN/strata" verify "$tmp/tp2" --recompute 2 --backend cuda --tp 2
  else
    echo "--tp 2 skipped: this machine has $ngpu GPU(s)"
  fi
}

case "${1:-}" in
  build) build ;;
  cli) shift; cli "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
