#!/usr/bin/env bash
# Installs the Debian packages the build and the tests need, when missing:
# libzmq (the engine subscriber and the simulated engines speak ZMQ through
# cgo, so kvrouter, kvagent and kvsim link it), a C compiler and libc's
# headers (cgo is off without one: pebbe/zmq4 and `go test -race` do not
# build, and Debian's Go does not bring one) and the python3 peers the
# interop tests drive (xxhash for hash vectors, zmq + msgpack for the engine
# publisher). `make build`, `make run` and `make test` call it; .ci/run too.
set -euo pipefail
pkgs=(libzmq3-dev pkg-config gcc libc6-dev)
if [ "${1:-}" = test ]; then
  pkgs+=(python3-xxhash python3-zmq python3-msgpack)
fi
# present PKG: whether what PKG gives the build is here, found by what it
# provides (pkg-config's libzmq, a compiler on PATH, a python module), so
# that a machine with them from elsewhere, or without dpkg, passes; dpkg's
# word only for what cannot be checked so (libc's headers: the compiler
# check stands for them off Debian).
present() {
  case $1 in
  libzmq3-dev) command -v pkg-config >/dev/null && pkg-config --exists libzmq ;;
  pkg-config) command -v pkg-config >/dev/null ;;
  gcc)
    # The compiler cgo runs: go env CC (gcc by default), as
    # CC=clang go build would have it.
    local cc
    cc=$(go env CC 2>/dev/null) || cc=""
    cc=${cc:-${CC:-gcc}}
    command -v "${cc%% *}" >/dev/null
    ;;
  libc6-dev)
    if command -v dpkg >/dev/null; then dpkg -s "$1" >/dev/null 2>&1; else present gcc; fi
    ;;
  # The tests run Debian's interpreter (internal/pypub), not a python3
  # first on PATH.
  python3-zmq) /usr/bin/python3 -c 'import zmq' 2>/dev/null ;;
  python3-msgpack) /usr/bin/python3 -c 'import msgpack' 2>/dev/null ;;
  python3-xxhash) /usr/bin/python3 -c 'import xxhash' 2>/dev/null ;;
  *) dpkg -s "$1" >/dev/null 2>&1 ;;
  esac
}
need=()
for p in "${pkgs[@]}"; do
  present "$p" || need+=("$p")
done
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "deps: missing ${need[*]} and no apt-get here; install them (libzmq with its headers, pkg-config, a C compiler)" >&2
  exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "deps: missing ${need[*]}; run as root or install sudo" >&2; exit 1; }
  sudo=(sudo)
fi
echo "deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq "${need[@]}"
