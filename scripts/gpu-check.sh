#!/usr/bin/env bash
# gpu-check.sh: check the offload copy backends and NVML telemetry on a GPU.
#
#   scripts/gpu-check.sh build OUTDIR   on a build machine with Go: compiles the
#                                       test binaries of ./offload/backend and
#                                       ./offload/nvml (and this script) into OUTDIR
#   scripts/gpu-check.sh run OUTDIR     on the GPU machine, no Go needed: runs them
#
# "run" prints an nvidia-smi summary, runs the CUDA conformance suite (verbose),
# the GPU and host bandwidth benchmarks (their BENCH lines) and the NVML
# inventory test. KVROUTER_EXPECT_GPU=1 turns every "no GPU" skip into a
# failure. It takes well under 5 minutes and exits non-zero on any failure.
# The binaries are linked against glibc >= 2.34 (cgo, as the agent is).
set -euo pipefail

[[ $# -eq 2 && ($1 == build || $1 == run) ]] || { echo "usage: $0 build|run OUTDIR" >&2; exit 2; }
out=$2

if [[ $1 == build ]]; then
  cd "$(dirname "$0")/.."
  mkdir -p "$out"
  # go-nvml's cgo preamble calls NVML functions marked deprecated.
  export CGO_CFLAGS="${CGO_CFLAGS:--O2 -g} -Wno-deprecated-declarations"
  go test -c -o "$out/backend.test" ./offload/backend
  go test -c -o "$out/nvml.test" ./offload/nvml
  cp scripts/gpu-check.sh "$out/"
  echo "built $out: backend.test nvml.test gpu-check.sh; on the GPU machine: $out/gpu-check.sh run $out"
  exit 0
fi

cd "$out"
export KVROUTER_EXPECT_GPU=1
step() { printf '\n== %s\n' "$*"; }

step "nvidia-smi"
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current \
  --format=csv || echo "(nvidia-smi failed; the tests below decide)"

step "CUDA conformance (and the host backend, for comparison)"
timeout 120 ./backend.test -test.v -test.count=1 -test.timeout=110s -test.run '^TestDetect' 2>&1 | grep -v ' INFO '
timeout 180 ./backend.test -test.v -test.count=1 -test.timeout=170s -test.run '^TestConformance$/^(cuda|host)$' 2>&1 |
  grep -v ' INFO '

step "bandwidth (2 MiB blocks)"
timeout 120 ./backend.test -test.run '^$' -test.bench '^(BenchmarkGPUCopy|BenchmarkHostCopy)$' -test.timeout=110s 2>&1 |
  grep -v ' INFO ' | tee bench.txt
grep -q '^BENCH offload.gpu ' bench.txt || { echo "no BENCH offload.gpu line" >&2; exit 1; }

step "NVML inventory"
timeout 60 ./nvml.test -test.v -test.count=1 -test.run '^(TestInventoryOnThisMachine|TestMissingNVMLReportsNoGPUAndTheProcessSurvives)$'

step "gpu-check: all passed"
