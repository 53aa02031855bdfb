package scripts_test

// Tests of scripts/deps.sh and scripts/run-local.sh (make run), run
// against fakes so that they need neither root nor a real cluster.

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func repoRoot(t *testing.T) string {
	_, f, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(f))
}

func writeExe(t *testing.T, path, body string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
}

// On a fresh Debian machine with Go, nothing gives cgo a C compiler: the
// build of kvrouter (pebbe/zmq4 is cgo-only) and `go test -race` need one,
// and deps.sh is what `make build/run/test` and .ci/run rely on to install
// what is missing. PATH holds only fakes (no compiler, no pkg-config, no
// go): fake dpkg says nothing is installed; fake apt-get records what
// deps.sh asks for.
func TestDepsInstallsACCompilerForCgo(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	rec := filepath.Join(dir, "apt.log")
	writeExe(t, filepath.Join(bin, "dpkg"), "#!/bin/bash\nexit 1\n")
	writeExe(t, filepath.Join(bin, "apt-get"), "#!/bin/bash\necho \"$@\" >> "+rec+"\n")
	writeExe(t, filepath.Join(bin, "id"), "#!/bin/bash\necho 0\n")
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	cmd := exec.Command(bash, filepath.Join(repoRoot(t), "scripts/deps.sh"), "test")
	cmd.Env = append(os.Environ(), "PATH="+bin, "CC=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("deps.sh: %v\n%s", err, out)
	}
	b, _ := os.ReadFile(rec)
	var installed string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "install") {
			installed = l
		}
	}
	for _, cc := range []string{"gcc", "build-essential", "clang"} {
		for _, f := range strings.Fields(installed) {
			if f == cc {
				return
			}
		}
	}
	t.Fatalf("deps.sh on a machine with nothing installed runs `apt-get %s`: no C compiler, so cgo is off and zmq4 / -race do not build", installed)
}

// README: "Both commands need Go (1.26) and libzmq". On a machine without
// dpkg/apt-get where libzmq is installed (pkg-config finds it) and a C
// compiler, deps.sh failed, and with it `make build` and `make run`.
func TestDepsAcceptsAnInstalledLibzmqWithoutDpkg(t *testing.T) {
	if exec.Command("pkg-config", "--exists", "libzmq").Run() != nil {
		t.Skip("no libzmq here")
	}
	bin := t.TempDir()
	for _, tool := range []string{"bash", "id", "pkg-config", "gcc"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Skip(tool)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(filepath.Join(bin, "bash"), filepath.Join(repoRoot(t), "scripts/deps.sh"))
	cmd.Env = []string{"PATH=" + bin}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("deps.sh with libzmq installed (pkg-config finds it) but no dpkg: %v\n%s", err, out)
	}
}

// runPorts are the ports of a run with one worker.
var runPorts = []int{7101, 7102, 7103, 7181, 7182, 7183, 4221, 4222, 4223, 6221, 6222, 6223, 5600, 5700}

// portInUse returns the first of ports that something listens on; 0 when
// none.
func portInUse(ports []int) int {
	for _, p := range ports {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(p), 200*time.Millisecond)
		if err == nil {
			c.Close()
			return p
		}
	}
	return 0
}

type fakeRun struct {
	cmd      *exec.Cmd
	root     string
	lines    chan string
	nodePids func() []int
	done     chan struct{} // closed once cmd.Wait has returned
	kill     func()        // the harness's cleanup: kills the script and every fake it started
}

// readPid reads the pid a fake wrote to path; 0 when there is none.
func readPid(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	p, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return p
}

// alive returns those of pids that still run.
func alive(pids []int) []string {
	var a []string
	for _, p := range pids {
		if p > 0 && syscall.Kill(p, 0) == nil {
			a = append(a, strconv.Itoa(p))
		}
	}
	return a
}

// pollGone polls until none of pids() runs, up to d; it returns those
// still running at the deadline.
func pollGone(pids func() []int, d time.Duration) []string {
	deadline := time.Now().Add(d)
	for {
		a := alive(pids())
		if len(a) == 0 || time.Now().After(deadline) {
			return a
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startFakeRun runs a copy of run-local.sh in a temporary tree where make
// build does nothing and bin/ holds fakes; kvsimBody is the fake kvsim,
// run in that tree (pids/ is where the fakes record their pids).
func startFakeRun(t *testing.T, kvsimBody string) *fakeRun {
	return startFakeRunWith(t, kvsimBody, "#!/bin/bash\nexit 0\n", nil)
}

// startFakeRunWith is startFakeRun with kvctlBody the fake kvctl, and
// setup, when not nil, given the tree and the command to change before it
// starts (it runs in the tree, with KVROUTER_RUN_TRACE=traces/t.jsonl).
func startFakeRunWith(t *testing.T, kvsimBody, kvctlBody string, setup func(root string, cmd *exec.Cmd)) *fakeRun {
	if p := portInUse(runPorts); p != 0 {
		t.Skipf("port %d in use", p)
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3")
	}
	root := t.TempDir()
	src, err := os.ReadFile(filepath.Join(repoRoot(t), "scripts/run-local.sh"))
	if err != nil {
		t.Fatal(err)
	}
	writeExe(t, filepath.Join(root, "scripts/run-local.sh"), string(src))
	if err := os.WriteFile(filepath.Join(root, "Makefile"), []byte("build:\n\t@true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "traces"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "traces/t.jsonl"), []byte("{}\n"), 0o644)
	pidDir := filepath.Join(root, "pids")
	os.MkdirAll(pidDir, 0o755)
	// The fakes below exit once the test process is gone (not their
	// parent, the script: TestRunLocalSecondCtrlCLeavesNoNode looks for
	// the nodes a killed script left running); the cleanup kills them
	// before.
	testPid := strconv.Itoa(os.Getpid())
	// Fake node: answers 200 on its --http-addr, records its pid.
	writeExe(t, filepath.Join(root, "bin/kvrouter"), `#!/usr/bin/env python3
import os, sys, http.server, threading, time
a = sys.argv
addr = a[a.index("--http-addr") + 1]
host, port = addr.rsplit(":", 1)
open(os.path.join("`+pidDir+`", a[a.index("--node-id") + 1]), "w").write(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *x): pass
def orphan():
    # The test process gone (a timeout's panic runs no cleanup): exit.
    while True:
        time.sleep(0.2)
        try: os.kill(`+testPid+`, 0)
        except OSError: os._exit(0)
threading.Thread(target=orphan, daemon=True).start()
http.server.HTTPServer((host, int(port)), H).serve_forever()
`)
	// Fake agent: takes 1 s to stop on SIGTERM (as a real one flushes its
	// last events); its pid, once its trap is set. It runs until the test
	// process is gone, as the fake node.
	writeExe(t, filepath.Join(root, "bin/kvagent"), "#!/bin/bash\ntrap 'sleep 1; exit 0' TERM\necho $$ > "+pidDir+"/agent\nwhile kill -0 "+testPid+" 2>/dev/null; do sleep 0.1; done\n")
	writeExe(t, filepath.Join(root, "bin/kvsim"), kvsimBody)
	writeExe(t, filepath.Join(root, "bin/kvctl"), kvctlBody)

	cmd := exec.Command("bash", filepath.Join(root, "scripts/run-local.sh"))
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KVROUTER_RUN_WORKERS=1", "KVROUTER_RUN_TRACE=traces/t.jsonl")
	if setup != nil {
		setup(root, cmd)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its own group, as at a terminal
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	nodePids := func() []int {
		var ps []int
		for _, n := range []string{"n1", "n2", "n3"} {
			if p := readPid(filepath.Join(pidDir, n)); p > 0 {
				ps = append(ps, p)
			}
		}
		return ps
	}
	kill := func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		// The nodes and agents run in sessions of their own (setsid),
		// out of the script's group: every process in the tree, until
		// none is left (a fake agent's sleep outlives it a moment).
		for i := 0; i < 50; i++ {
			ps := inTree(root, "")
			if len(ps) == 0 {
				break
			}
			for _, p := range ps {
				syscall.Kill(p, syscall.SIGKILL)
			}
			time.Sleep(20 * time.Millisecond)
		}
		// The next test's run needs the ports: wait for the killed
		// nodes to let them go.
		deadline := time.Now().Add(5 * time.Second)
		for portInUse(runPorts) != 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	t.Cleanup(kill)
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	r := &fakeRun{cmd: cmd, root: root, lines: lines, nodePids: nodePids, done: make(chan struct{}), kill: kill}
	go func() {
		cmd.Wait()
		close(r.done)
	}()
	return r
}

// inTree returns the processes that run in the fake tree root (their
// working directory: run-local.sh cds there, and what it starts inherits
// it) and whose command line holds s ("": any).
func inTree(root, s string) []int {
	ents, _ := os.ReadDir("/proc")
	var ps []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd")); err != nil || cwd != root {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if strings.Contains(string(b), s) {
			ps = append(ps, p)
		}
	}
	return ps
}

// waitFor reads the script's output until a line holds s.
func (r *fakeRun) waitFor(t *testing.T, s string, log *[]string) {
	deadline := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-r.lines:
			if !ok {
				t.Fatalf("script ended before %q:\n%s", s, strings.Join(*log, "\n"))
			}
			*log = append(*log, l)
			if strings.Contains(l, s) {
				return
			}
		case <-deadline:
			t.Fatalf("no %q after 30s:\n%s", s, strings.Join(*log, "\n"))
		}
	}
}

// A second Ctrl-C while run-local.sh stops the agents (stop reset the INT
// trap to the default before it stopped anything) killed the script before
// it had sent SIGTERM to the nodes, which run in sessions of their own:
// the whole cluster was left running, holding every port, and the next
// `make run` refused to start. Fakes stand in for make build and the
// binaries.
func TestRunLocalSecondCtrlCLeavesNoNode(t *testing.T) {
	r := startFakeRun(t, "#!/bin/bash\nexit 0\n")
	var log []string
	r.waitFor(t, "Ctrl-C stops the cluster", &log)
	deadline := time.Now().Add(10 * time.Second)
	for readPid(filepath.Join(r.root, "pids/agent")) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the fake agent did not start within 10s:\n%s", strings.Join(log, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGINT) // Ctrl-C
	// Ctrl-C again while the agents stop (each takes 1 s).
	r.waitFor(t, "stopping the agents", &log)
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGINT)
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("script still running 30s after the second Ctrl-C:\n%s", strings.Join(log, "\n"))
	}
	for l := range r.lines {
		log = append(log, l)
	}
	// The script waits for its nodes before it exits; the poll leaves a
	// node that was signalled only a moment to go.
	if a := pollGone(r.nodePids, 2*time.Second); len(a) > 0 {
		t.Fatalf("after two Ctrl-C the script exited (%v) but nodes %s still run and hold their ports; its output ends:\n%s",
			r.cmd.ProcessState, strings.Join(a, ","), strings.Join(log[max(0, len(log)-3):], "\n"))
	}
}

// run-local.sh says SIGTERM is a clean stop like Ctrl-C, but a `kill` of
// the script during the replay (kvsim in the foreground, which does not
// get the signal) was only acted on once the whole replay had ended: bash
// runs a trap after the foreground command. A 120 s fake replay stands in
// for kvsim; the script must stop well before it ends (30 s: a loaded
// 2-core -race run takes seconds to run bash's trap, the nodes' and the
// agent's stops), kvsim with it.
func TestRunLocalSIGTERMDuringReplayStopsPromptly(t *testing.T) {
	r := startFakeRun(t, "#!/bin/bash\necho $$ > pids/kvsim\nexec sleep 120\n")
	var log []string
	r.waitFor(t, "kvagents for simulated workers", &log)
	kvsimPid := func() []int { return []int{readPid(filepath.Join(r.root, "pids/kvsim"))} }
	deadline := time.Now().Add(10 * time.Second)
	for kvsimPid()[0] == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the fake kvsim did not start within 10s:\n%s", strings.Join(log, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	start := time.Now()
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("script still running 30s after its SIGTERM (the replay runs on to its end)")
	}
	t.Logf("script stopped %v after its SIGTERM", time.Since(start).Round(100*time.Millisecond))
	if a := pollGone(kvsimPid, 10*time.Second); len(a) > 0 {
		t.Fatalf("script stopped but kvsim %s still runs", strings.Join(a, ","))
	}
}

// make tools installed staticcheck to .tools/staticcheck, a target with no
// prerequisites: once there, a change of STATICCHECK_VERSION never
// reinstalled it, and make lint went on running the old pin. Dry runs
// (make -n) with .tools holding an older staticcheck.
func TestMakeToolsReinstallsStaticcheckOnAPinChange(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	tools := t.TempDir()
	// What an earlier pin left: both layouts, the old and the versioned.
	writeExe(t, filepath.Join(tools, "staticcheck"), "#!/bin/sh\n")
	writeExe(t, filepath.Join(tools, "staticcheck-v0.0.1", "staticcheck"), "#!/bin/sh\n")
	cmd := exec.Command("make", "-n", "-C", repoRoot(t), "tools", "TOOLS="+tools, "STATICCHECK_VERSION=v0.0.2")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make -n tools: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "staticcheck@v0.0.2") {
		t.Fatalf("make tools with the pin moved to v0.0.2 and an older staticcheck in %s installs nothing:\n%s", tools, out)
	}
}

// KVROUTER_RUN_TRACE and KVROUTER_RUN_DIR given relative to where make run
// was started were taken from the repository's root (the script cds there
// first): the trace was not found, and the data went elsewhere. And a
// kvctl status that failed (a node not answering right then) ended the run
// under set -e. The fake kvctl fails; the fake kvsim records its trace.
func TestRunLocalRelativePathsAndAFailingStatus(t *testing.T) {
	caller := t.TempDir()
	if err := os.WriteFile(filepath.Join(caller, "mine.jsonl"), []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	kvsim := "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --trace ] && echo \"$2\" > pids/trace; shift; done\n"
	r := startFakeRunWith(t, kvsim, "#!/bin/bash\necho 'kvctl: no node answered' >&2\nexit 1\n", func(root string, cmd *exec.Cmd) {
		cmd.Dir = caller
		cmd.Env = append(cmd.Env, "KVROUTER_RUN_TRACE=mine.jsonl", "KVROUTER_RUN_DIR=rundata")
	})
	var log []string
	r.waitFor(t, "Ctrl-C stops the cluster", &log)
	b, err := os.ReadFile(filepath.Join(r.root, "pids/trace"))
	if err != nil {
		t.Fatalf("kvsim did not replay (%v):\n%s", err, strings.Join(log, "\n"))
	}
	if got, want := strings.TrimSpace(string(b)), filepath.Join(caller, "mine.jsonl"); got != want {
		t.Errorf("kvsim replayed --trace %s, want %s", got, want)
	}
	if _, err := os.Stat(filepath.Join(caller, "rundata", "node1.log")); err != nil {
		t.Errorf("KVROUTER_RUN_DIR=rundata from %s: %v", caller, err)
	}
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGINT)
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("script still running 30s after its Ctrl-C")
	}
}

// benchScratch returns a scratch directory holding a copy of
// scripts/bench.sh, for a test that runs it against a fake go; it skips
// the test where a tool the script uses is missing.
func benchScratch(t *testing.T) string {
	t.Helper()
	for _, tool := range []string{"bash", "git", "awk", "nproc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skip("no " + tool)
		}
	}
	root := t.TempDir()
	script, err := os.ReadFile(filepath.Join(repoRoot(t), "scripts/bench.sh"))
	if err != nil {
		t.Fatal(err)
	}
	writeExe(t, filepath.Join(root, "scripts/bench.sh"), string(script))
	return root
}

// TestBenchStampIgnoresWhatTheBenchmarksWrite pins docs/benchmarks.md's
// rule: "a commit ending in `-dirty` means the working tree had changes
// no commit holds (the benchmark outputs themselves aside)". TestBenchSim
// (make bench-sim) rewrites docs/sim.md and docs/sim/*.png, so in `make
// bench` every area run after sim (compat, offload) must still carry the
// clean commit of a clean checkout. Run against a fake go in a scratch
// git repository holding bench.sh: each area prints one BENCH line, and
// the sim area rewrites docs/sim.md as the real benchmark does.
func TestBenchStampIgnoresWhatTheBenchmarksWrite(t *testing.T) {
	root := benchScratch(t)
	writeExe(t, filepath.Join(root, "docs/benchmarks.md"), "# Benchmarks\n\n<!-- generated below -->\n")
	writeExe(t, filepath.Join(root, "docs/sim.md"), "# sim\n\nGenerated 2026-01-01\n")
	writeExe(t, filepath.Join(root, "docs/sim/plot.png"), "png 1\n")
	// The fake go: one BENCH line per area; the sim area's test rewrites
	// docs/sim.md and its plots below the repository root, as TestBenchSim
	// does (the script runs go from the root).
	bin := filepath.Join(root, ".fakebin")
	writeExe(t, filepath.Join(bin, "go"), `#!/bin/bash
for a in "$@"; do
  if [ "$a" = ./sim/ ]; then
    echo "Generated $(date +%s%N)" >> docs/sim.md
    echo "png $(date +%s%N)" > docs/sim/plot.png
  fi
done
echo "BENCH fake.figure args=$#"
echo "ok  	fake"
`)
	git := func(args ...string) string {
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"}, args...)...)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	writeExe(t, filepath.Join(root, ".gitignore"), "/.fakebin/\n")
	git("init", "-q")
	git("add", "-A")
	git("commit", "-q", "-m", "clean")
	head := git("rev-parse", "--short", "HEAD")

	cmd := exec.Command("bash", "scripts/bench.sh", "all")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("bench.sh all: %v\n%s", err, out)
	}
	for _, area := range []string{"indexer", "events", "cluster", "eventplane", "sim", "compat", "offload"} {
		b, err := os.ReadFile(filepath.Join(root, "docs/bench", area+".txt"))
		if err != nil {
			t.Fatal(err)
		}
		var stamp string
		for _, l := range strings.Split(string(b), "\n") {
			if s, ok := strings.CutPrefix(l, "# commit: "); ok {
				stamp = s
			}
		}
		if stamp != head {
			t.Errorf("bench-%s of a clean checkout at %s is stamped %q: the run's own outputs (docs/sim.md, docs/sim/*.png) made it -dirty", area, head, stamp)
		}
	}
}

// TestBenchFailsWhenGoTestFails pins scripts/bench.sh's contract ("bench-<area>
// failed", exit 1, the area's figures left as they were) for a go test
// that fails without printing a line starting with FAIL: the go command's
// own errors, such as an older local toolchain refusing go.mod's go line
// ("go: go.mod requires go >= …"), exit 1 before any test runs. The
// script took the missing FAIL line for success: it replaced the area's
// collected BENCH lines with none, rebuilt docs/benchmarks.md without
// them and said "docs/benchmarks.md updated", exit 0.
func TestBenchFailsWhenGoTestFails(t *testing.T) {
	root := benchScratch(t)
	const old = "BENCH indexer.apply block_events_per_s=3e+06 ratio=2.5"
	writeExe(t, filepath.Join(root, "docs/bench/indexer.txt"), "# bench-indexer\n"+old+"\n")
	writeExe(t, filepath.Join(root, "docs/benchmarks.md"), "# Benchmarks\n\n<!-- generated below -->\n\n### indexer\n\n```\n"+old+"\n```\n")
	bin := filepath.Join(t.TempDir(), "bin")
	writeExe(t, filepath.Join(bin, "go"), "#!/bin/bash\necho 'go: go.mod requires go >= 1.26.0 (running go 1.24.0; GOTOOLCHAIN=local)' >&2\nexit 1\n")

	cmd := exec.Command("bash", "scripts/bench.sh", "indexer")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Errorf("bench.sh indexer exited 0 although go test failed:\n%s", out)
	}
	for _, f := range []string{"docs/bench/indexer.txt", "docs/benchmarks.md"} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), old) {
			t.Errorf("%s lost the last run's figures after a failed run:\n%s", f, b)
		}
	}
}

// The harness's cleanup killed the script's process group, the three
// nodes and the one agent whose pid pids/agent held (the last to write
// it): the nodes and agents run in sessions of their own (setsid), out of
// the group, so a test that failed with several agents up left the others
// running, orphaned (a failed run of 101 workers left 101 fake kvagents
// running for 20 minutes). Pinned: once the cleanup has run, nothing runs
// in the fake tree, with three agents up.
func TestRunLocalHarnessLeavesNothingRunning(t *testing.T) {
	if _, err := os.Stat("/proc/self/cwd"); err != nil {
		t.Skip("no /proc")
	}
	r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", func(root string, cmd *exec.Cmd) {
		cmd.Env = append(cmd.Env, "KVROUTER_RUN_WORKERS=3")
	})
	var log []string
	r.waitFor(t, "Ctrl-C stops the cluster", &log)
	deadline := time.Now().Add(10 * time.Second)
	for len(inTree(r.root, "bin/kvagent")) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("the 3 fake agents did not start within 10s:\n%s", strings.Join(log, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.kill()
	if a := pollGone(func() []int { return inTree(r.root, "") }, 2*time.Second); len(a) > 0 {
		t.Fatalf("after the harness's cleanup, processes %s still run in the fake tree", strings.Join(a, ","))
	}
}

// toFile is a startFakeRunWith setup that sends the script's output to
// root/out.txt instead of the harness's pipe, whose last lines a script
// that exits at once can lose (cmd.Wait closes the pipe before they are
// read); it returns the file's path.
func toFile(out *string, env ...string) func(root string, cmd *exec.Cmd) {
	return func(root string, cmd *exec.Cmd) {
		*out = filepath.Join(root, "out.txt")
		cmd.Args = []string{"bash", "-c", `exec bash "$0" >"$1" 2>&1`, filepath.Join(root, "scripts/run-local.sh"), *out}
		cmd.Env = append(cmd.Env, env...)
	}
}

// waitEnd waits, up to 30 s, for the script to end and returns its
// output; it fails the test at once when the script has launched the
// nodes (it says "waiting for the cluster to be ready" right after: the
// fake nodes themselves may take long to start on a loaded machine).
func waitEnd(t *testing.T, r *fakeRun, out, what string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-r.done:
			b, _ := os.ReadFile(out)
			return string(b)
		case <-time.After(20 * time.Millisecond):
		}
		b, _ := os.ReadFile(out)
		if strings.Contains(string(b), "waiting for the cluster to be ready") {
			t.Fatalf("%s launched the cluster's nodes instead of being refused first:\n%s", what, b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: script still running 30s after its start:\n%s", what, b)
		}
	}
}

// README's KVROUTER_RUN_* table: KVROUTER_RUN_REQUESTS is "how many of the
// trace's requests are replayed" and KVROUTER_RUN_WORKERS the simulated
// workers, one kvagent each on ports 5600+ and 5700+. A value that is no
// such number (abc, 0, -1, or more workers than the ports below 5700
// hold) was taken as given: the script started the three nodes (and the
// agents it could), kvsim then failed on the value, and the run went on
// "serving routes" as if the replay had run, Ctrl-C ending it with status
// 0. Pinned: each is refused before any node starts, with status 2 and a
// message naming the variable.
func TestRunLocalRejectsABadSizeBeforeStarting(t *testing.T) {
	for _, c := range []struct{ name, env string }{
		{"requests-abc", "KVROUTER_RUN_REQUESTS=abc"},
		{"workers-0", "KVROUTER_RUN_WORKERS=0"},
		{"workers-abc", "KVROUTER_RUN_WORKERS=abc"},
		{"requests-negative", "KVROUTER_RUN_REQUESTS=-1"},
		// Worker 101's engine wire would be 5700, worker 1's replay port.
		{"workers-101", "KVROUTER_RUN_WORKERS=101"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out string
			r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", toFile(&out, c.env))
			log := waitEnd(t, r, out, c.env)
			if code := r.cmd.ProcessState.ExitCode(); code != 2 {
				t.Errorf("%s: exit status %d, want 2 (a usage error):\n%s", c.env, code, log)
			}
			if name, _, _ := strings.Cut(c.env, "="); !strings.Contains(log, name) {
				t.Errorf("%s: the refusal does not name %s:\n%s", c.env, name, log)
			}
		})
	}
}

// A replay that failed (kvsim exiting non-zero: a malformed trace, a value
// it refused) was hidden by `wait "$replayer" || true`: the script went on
// "serving routes", and Ctrl-C ended the run with status 0. Pinned: the
// script says the replay failed, stops the agents and the nodes as Ctrl-C
// does, and exits with kvsim's status; nothing is left running.
func TestRunLocalFailedReplayStopsTheRun(t *testing.T) {
	var out string
	r := startFakeRunWith(t, "#!/bin/bash\necho 'kvsim: trace line 1: unexpected end of JSON input' >&2\nexit 3\n", "#!/bin/bash\nexit 0\n", toFile(&out))
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		b, _ := os.ReadFile(out)
		t.Fatalf("script still running 30s after a replay that failed:\n%s", b)
	}
	b, _ := os.ReadFile(out)
	log := string(b)
	if code := r.cmd.ProcessState.ExitCode(); code != 3 || !strings.Contains(log, "the replay failed (exit 3)") {
		t.Fatalf("a replay that failed with status 3: script exit status %d, want 3 and \"the replay failed (exit 3)\":\n%s", code, log)
	}
	if strings.Contains(log, "serving routes") || !strings.Contains(log, "stopping the cluster") {
		t.Errorf("a replay that failed: the run went on serving routes, or did not stop the cluster:\n%s", log)
	}
	agent := func() []int { return append(r.nodePids(), readPid(filepath.Join(r.root, "pids/agent"))) }
	if a := pollGone(agent, 2*time.Second); len(a) > 0 {
		t.Errorf("the script exited after a failed replay, but nodes or the agent %s still run", strings.Join(a, ","))
	}
}

// A second `make run` while one runs is refused on the first port in use,
// but its exit went through the Ctrl-C path, which printed "stopped; data
// kept in data/ (rm -rf data to start afresh)": nothing was stopped, and
// with the default KVROUTER_RUN_DIR that directory is the running
// cluster's, whose data the advice deletes. Pinned: a refused run says
// neither. A listener on worker 2's replay port (5701, outside runPorts)
// stands in for the other run. It is also the test of the port check
// itself: with the check turned into `if false`, every other run-local
// test passed, and this one fails ("launched the cluster's nodes instead
// of being refused first").
func TestRunLocalRefusedRunNeitherStopsNorAdvisesRm(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:5701")
	if err != nil {
		t.Skipf("port 5701: %v", err)
	}
	defer l.Close()
	var out string
	r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", toFile(&out, "KVROUTER_RUN_WORKERS=2"))
	log := waitEnd(t, r, out, "a run with port 5701 in use")
	if !strings.Contains(log, "port 5701") || r.cmd.ProcessState.ExitCode() == 0 {
		t.Fatalf("a run with port 5701 in use: %v, not refused naming the port:\n%s", r.cmd.ProcessState, log)
	}
	if strings.Contains(log, "rm -rf") || strings.Contains(log, "stopped") {
		t.Errorf("a run refused before it started anything tells the operator it stopped and to rm -rf the data directory (another run's):\n%s", log)
	}
}

// KVROUTER_RUN_REQUESTS sizes the replay only: with KVROUTER_RUN_REPLAY=0,
// or no trace at KVROUTER_RUN_TRACE (the run then serves routes without a
// replay), nothing reads it, yet a bad value refused the run (status 2).
// Pinned: such a run starts and serves routes whatever the value, and
// KVROUTER_RUN_WORKERS, which sizes the agents, is still checked with the
// replay off. From a review.
func TestRunLocalChecksTheRequestsOnlyForAReplay(t *testing.T) {
	for _, c := range []struct {
		name string
		env  []string
	}{
		{"replay-off", []string{"KVROUTER_RUN_REPLAY=0", "KVROUTER_RUN_REQUESTS=abc"}},
		{"no-trace", []string{"KVROUTER_RUN_TRACE=traces/none.jsonl", "KVROUTER_RUN_REQUESTS=-1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", func(_ string, cmd *exec.Cmd) {
				cmd.Env = append(cmd.Env, c.env...)
			})
			var log []string
			r.waitFor(t, "serving routes", &log)
		})
	}
	t.Run("workers-with-the-replay-off", func(t *testing.T) {
		var out string
		env := []string{"KVROUTER_RUN_REPLAY=0", "KVROUTER_RUN_WORKERS=abc"}
		r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", toFile(&out, env...))
		log := waitEnd(t, r, out, strings.Join(env, " "))
		if code := r.cmd.ProcessState.ExitCode(); code != 2 || !strings.Contains(log, "KVROUTER_RUN_WORKERS") {
			t.Errorf("%s: exit status %d, want 2 naming KVROUTER_RUN_WORKERS:\n%s", env, code, log)
		}
	})
}

// TestRunLocalWithoutAReplayLeavesTheAgentsPortsAlone: a run that will
// replay nothing (no trace at KVROUTER_RUN_TRACE) starts no agent, so the
// agents' ports (5600+, 5700+) in use do not refuse it. From a review:
// the port check reserved them whenever KVROUTER_RUN_REPLAY was not 0,
// the trace missing or not.
func TestRunLocalWithoutAReplayLeavesTheAgentsPortsAlone(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:5701")
	if err != nil {
		t.Skipf("port 5701: %v", err)
	}
	defer l.Close()
	r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", func(_ string, cmd *exec.Cmd) {
		cmd.Env = append(cmd.Env, "KVROUTER_RUN_TRACE=traces/none.jsonl", "KVROUTER_RUN_WORKERS=2")
	})
	var log []string
	r.waitFor(t, "serving routes", &log)
}

// A Ctrl-C while `make run` builds (its `make -s build`, before the
// script's traps were installed) ended the script with the build, saying
// nothing of it, and a build that finished despite the Ctrl-C went on to
// start the cluster. Pinned: the script exits 130, says that it was
// interrupted before anything started, and starts no node. A build that
// sleeps stands in for make build.
func TestRunLocalCtrlCDuringTheBuildStartsNothing(t *testing.T) {
	var out string
	r := startFakeRunWith(t, "#!/bin/bash\nexit 0\n", "#!/bin/bash\nexit 0\n", func(root string, cmd *exec.Cmd) {
		toFile(&out)(root, cmd)
		if err := os.WriteFile(filepath.Join(root, "Makefile"), []byte("build:\n\t@touch building; sleep 120\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for _, err := os.Stat(filepath.Join(r.root, "building")); err != nil; _, err = os.Stat(filepath.Join(r.root, "building")) {
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(out)
			t.Fatalf("the fake build did not start within 10s:\n%s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGINT) // Ctrl-C
	select {
	case <-r.done:
	case <-time.After(30 * time.Second): // far less than the build's 120 s
		b, _ := os.ReadFile(out)
		t.Fatalf("script still running 30s after a Ctrl-C during the build:\n%s", b)
	}
	b, _ := os.ReadFile(out)
	log := string(b)
	if code := r.cmd.ProcessState.ExitCode(); code != 130 || !strings.Contains(log, "interrupted before anything started") {
		t.Errorf("a Ctrl-C during the build: %v, want exit status 130 and \"interrupted before anything started\":\n%s", r.cmd.ProcessState, log)
	}
	if ps := r.nodePids(); len(ps) > 0 || strings.Contains(log, "waiting for the cluster") {
		t.Errorf("a Ctrl-C during the build: nodes %v started:\n%s", ps, log)
	}
}
