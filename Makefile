# kvrouter — see README.md. Every target works on a fresh machine: tools are
# installed into .tools/ at pinned versions, system packages by .ci/run.
SHELL := /bin/bash
GO ?= go
TOOLS := $(CURDIR)/.tools
STATICCHECK_VERSION := v0.8.2
PKGS := ./...
# Per test binary. raftfsm takes about 9 minutes under -race on an idle
# 2-core machine (559 s in a CI run of 2026-12-06, of 900 s allowed then),
# and it, cmd/kvrouter and cmd/kvagent ran past 900 s at a load average of
# 70-100: the watchdog (internal/testwatch) then named a test that was
# running, not hung. A hung test still fails well inside CI's 90 minutes.
TEST_TIMEOUT ?= 1800s
# go-nvml's cgo preamble calls NVML functions that newer headers mark
# deprecated; silence those warnings (and only those) in every build.
export CGO_CFLAGS := -O2 -g -Wno-deprecated-declarations

.PHONY: all deps build test test-long lint fmt bench bench-indexer bench-events bench-cluster bench-sim bench-eventplane bench-compat bench-offload run replay clean tools gpu-check gpu-check-build

all: build

# libzmq (cgo) and, for the tests, the python3 interop peers.
deps:
	@scripts/deps.sh

build: deps
	$(GO) build -o bin/ ./cmd/...

# The tests that read a package's raceEnabled constant (skipped or
# weakened under -race) run once more without it: their names match
# NORACE_RUN and their packages are in NORACE_PKGS. internal/doccheck's
# TestEveryRaceSkippedTestRunsWithoutRace holds every such test to both.
NORACE_RUN = Alloc|Memory
NORACE_PKGS = ./indexer/ ./kvevent/... ./compat/ ./api/ ./eventplane/ ./raftfsm/

test:
	@scripts/deps.sh test
	$(GO) test -race -timeout $(TEST_TIMEOUT) $(PKGS)
	# Allocation and memory checks once more without -race, which skips
	# or weakens them (the race detector makes sync.Pool drop its items).
	$(GO) test -count=1 -run '$(NORACE_RUN)' $(NORACE_PKGS)

# Soak, chaos and long property runs; not part of CI's time budget.
test-long:
	@scripts/deps.sh test
	KVROUTER_LONG=1 $(GO) test -race -timeout 60m $(PKGS)

# The CUDA backend's conformance tests, the copy-bandwidth benchmark and
# the NVML inventory on a GPU machine (scripts/gpu-check.sh, docs/offload.md):
# builds the test binaries into .gpu-check/ and runs them; it fails on a
# machine without a GPU. A GPU machine without Go runs
# `.gpu-check/gpu-check.sh run .gpu-check` from a tree where
# `make gpu-check-build` ran.
gpu-check: gpu-check-build
	scripts/gpu-check.sh run .gpu-check

gpu-check-build: deps
	scripts/gpu-check.sh build .gpu-check

# Installed under its version (.tools/staticcheck-vX/staticcheck): a new
# pin is a new target, which make installs, instead of taking the old
# pin's binary for up to date.
STATICCHECK := $(TOOLS)/staticcheck-$(STATICCHECK_VERSION)/staticcheck
$(STATICCHECK):
	GOBIN=$(dir $@) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

tools: $(STATICCHECK)

lint: tools deps
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(STATICCHECK) $(PKGS)

fmt:
	gofmt -w $$(git ls-files '*.go')

# Benchmarks print "BENCH area.figure k=v ..." lines; `make bench` collects
# them into docs/benchmarks.md.
bench:
	scripts/bench.sh all

bench-indexer:
	scripts/bench.sh indexer

bench-events:
	scripts/bench.sh events

bench-cluster:
	scripts/bench.sh cluster

bench-sim:
	scripts/bench.sh sim

bench-eventplane:
	scripts/bench.sh eventplane

bench-compat:
	scripts/bench.sh compat

bench-offload:
	scripts/bench.sh offload

# The main job: a local 3-node cluster serving routes (see scripts/run-local.sh).
run:
	scripts/run-local.sh

# The in-process trace replay (no cluster): hit rate and imbalance per policy.
replay: deps
	$(GO) run ./cmd/kvsim replay --trace traces/mooncake_synthetic_trace.jsonl

clean:
	rm -rf bin .gpu-check
