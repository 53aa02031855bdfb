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
need=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
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
