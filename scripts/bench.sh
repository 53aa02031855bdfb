#!/usr/bin/env bash
# Runs the benchmarks of one area (or all) and refreshes docs/benchmarks.md.
#
# Every benchmark prints "BENCH area.figure k=v ..." lines, each measured
# against a baseline in the same run (see docs/benchmarks.md). This script
# collects those lines per area into docs/bench/<area>.txt and rebuilds
# docs/benchmarks.md from all collected areas, with the machine, date and
# commit of each run.
set -euo pipefail
cd "$(dirname "$0")/.."

area=${1:-all}
out=docs/bench
mkdir -p "$out"

# area -> "packages|test pattern"
declare -A spec=(
  [indexer]="./indexer/|TestBench"
  [events]="./kvevent/engine/|TestBenchDecode"
  [cluster]="-p 1 ./raftfsm/ ./benchcluster/|TestBenchCluster"
  [eventplane]="./eventplane/|TestBenchEventsE2E"
  [sim]="./sim/|TestBenchSim"
  [compat]="./compat/|TestBenchCompat"
  [offload]="./offload/pool/|TestBenchOffload"
)
order=(indexer events cluster eventplane sim compat offload)

# commit_stamp prints HEAD's short hash, with "-dirty" when the working tree
# differs from it (uncommitted or untracked files): the figures then come
# from code no commit holds. The files the run itself rewrites do not
# count, or every area after the first that writes one would be marked:
# this script's (docs/bench/, docs/benchmarks.md) and the benchmarks' own
# (TestBenchSim's docs/sim.md and docs/sim/*.png). A benchmark that comes
# to write another file under docs/ adds it to bench_outputs.
bench_outputs=(docs/bench docs/benchmarks.md docs/benchmarks.md.new docs/sim.md 'docs/sim/*.png')
commit_stamp() {
  local c p excludes=()
  c=$(git rev-parse --short HEAD 2>/dev/null) || { echo unknown; return; }
  for p in "${bench_outputs[@]}"; do excludes+=(":(exclude,glob)$p"); done
  if [ -n "$(git status --porcelain -- . "${excludes[@]}" 2>/dev/null)" ]; then
    c+=-dirty
  fi
  echo "$c"
}

run_area() {
  local a=$1 pkgs pattern log commit rc=0
  IFS='|' read -r pkgs pattern <<<"${spec[$a]}"
  commit=$(commit_stamp) # the tree the benchmarks are built from
  log=$(mktemp)
  echo "== bench-$a" >&2
  # go test's exit status (pipefail: tee and the grep, which may find no
  # BENCH line, exit 0) fails the area as a FAIL line does: the go
  # command's own errors ("go: go.mod requires go >= ...") print none.
  # shellcheck disable=SC2086
  KVROUTER_BENCH=1 go test -count=1 -timeout 60m -run "$pattern" -v $pkgs 2>&1 | tee "$log" | { grep '^BENCH' >&2 || true; } || rc=$?
  if [ "$rc" -ne 0 ] || grep -q '^FAIL' "$log"; then
    cat "$log" >&2
    rm -f "$log"
    echo "bench-$a failed" >&2
    exit 1
  fi
  {
    echo "# bench-$a"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# commit: $commit"
    echo "# machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
    grep '^BENCH' "$log" || true
  } >"$out/$a.txt"
  rm -f "$log"
}

if [ "$area" = all ]; then
  for a in "${order[@]}"; do run_area "$a"; done
else
  [ -n "${spec[$area]+x}" ] || { echo "unknown bench area: $area (have: ${order[*]})" >&2; exit 2; }
  run_area "$area"
fi

# Rebuild the generated part of docs/benchmarks.md from every area's file.
{
  sed -n '1,/^<!-- generated below -->$/p' docs/benchmarks.md
  for a in "${order[@]}"; do
    [ -f "$out/$a.txt" ] || continue
    echo
    echo "### $a"
    echo
    echo '```'
    cat "$out/$a.txt"
    echo '```'
  done
} >docs/benchmarks.md.new
mv docs/benchmarks.md.new docs/benchmarks.md
echo "docs/benchmarks.md updated" >&2
