package testwatch

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	Start()
	os.Exit(m.Run())
}

// TestReportNamesTheHungTestLast: a test binary whose test hangs is
// stopped by the watchdog before its -test.timeout, with status 2, and the
// last lines of its output name the test and the frame it is stuck in.
func TestReportNamesTheHungTestLast(t *testing.T) {
	if os.Getenv("TESTWATCH_HANG") == "1" {
		t.Skip("the helper runs only in the child")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHangs$", "-test.timeout=3s")
	cmd.Env = append(os.Environ(), "TESTWATCH_HANG=1")
	out, err := cmd.CombinedOutput()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 2 {
		t.Fatalf("child ended with %v, want exit status 2; output:\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	last := lines[len(lines)-1]
	if last != "testwatch: running tests: TestHelperHangs" {
		t.Fatalf("last line %q; output:\n%s", last, out)
	}
	entry := lines[len(lines)-2]
	if !strings.HasPrefix(entry, "  TestHelperHangs [chan receive") || !strings.Contains(entry, "internal/testwatch.hangHere testwatch_test.go:") {
		t.Fatalf("entry %q does not name the test, its state and the frame it waits in", entry)
	}
	if bytes.Contains(out, []byte("panic: test timed out")) {
		t.Fatal("Go's own timeout fired first")
	}
}

func TestHelperHangs(t *testing.T) {
	if os.Getenv("TESTWATCH_HANG") != "1" {
		t.Skip("run by TestReportNamesTheHungTestLast")
	}
	hangHere(make(chan struct{}))
}

//go:noinline
func hangHere(c chan struct{}) { <-c }

// TestSummarizeSkipsGoroutinesOfNoTest: only goroutines that run a test
// get an entry; a cleanup's closure is named after its test.
func TestSummarizeSkipsGoroutinesOfNoTest(t *testing.T) {
	const dump = `goroutine 7 [select]:
github.com/hashicorp/raft.(*Raft).run(0xc0)
	/mod/raft/raft.go:1 +0x1
created by github.com/hashicorp/raft.NewRaft in goroutine 5
	/mod/raft/api.go:2 +0x2

goroutine 5 [semacquire, 14 minutes]:
sync.runtime_SemacquireWaitGroup(0xc0)
	/go/src/runtime/sema.go:114 +0x2e
sync.(*WaitGroup).Wait(0xc0)
	/go/src/sync/waitgroup.go:118 +0x48
github.com/kvrouter/kvrouter/raftfsm.(*Node).Close(0xc0)
	/w/raftfsm/node.go:343 +0x5
github.com/kvrouter/kvrouter/raftfsm.TestSomething.func2()
	/w/raftfsm/x_test.go:9 +0x5
testing.(*common).Cleanup.func1()
	/go/src/testing/testing.go:1 +0x1
testing.tRunner(0xc0, 0x1)
	/go/src/testing/testing.go:2 +0x2
created by testing.(*T).Run in goroutine 1
	/go/src/testing/testing.go:3 +0x3`
	var b bytes.Buffer
	Report(&b, []byte(dump), 0)
	out := b.String()
	want := "  TestSomething [semacquire, 14 minutes]: sync.runtime_SemacquireWaitGroup sema.go:114 <- sync.(*WaitGroup).Wait waitgroup.go:118 <- raftfsm.(*Node).Close node.go:343 <- raftfsm.TestSomething.func2 x_test.go:9\ntestwatch: running tests: TestSomething\n"
	if !strings.HasSuffix(out, want) {
		t.Fatalf("report ends\n%s\nwant it to end\n%s", out[len(out)-min(len(out), 400):], want)
	}
}

// TestWithinFailsWithoutASend: Within returns what comes, and fails the
// test (here a recorder) when nothing does.
func TestWithinFailsWithoutASend(t *testing.T) {
	ch := make(chan int, 1)
	ch <- 7
	if got := Within(t, time.Second, ch, "seven"); got != 7 {
		t.Fatalf("got %d", got)
	}
	rec := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Within(rec, 10*time.Millisecond, make(chan int), "nothing")
	}()
	<-done
	if !strings.Contains(rec.msg, "timed out after 10ms waiting for nothing") {
		t.Fatalf("failure %q", rec.msg)
	}
}

// fatalRecorder records a Fatalf and ends its goroutine, as testing does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// TestBenchmarksOutliveTheWatchdog: Go's -test.timeout does not cover
// benchmarks, and neither does the watchdog: a benchmark that runs past
// the timeout ends normally.
func TestBenchmarksOutliveTheWatchdog(t *testing.T) {
	if os.Getenv("TESTWATCH_HANG") == "1" {
		t.Skip("runs only in the parent")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^BenchmarkPastTheTimeout$", "-test.benchtime=1x", "-test.timeout=1s")
	cmd.Env = append(os.Environ(), "TESTWATCH_BENCH=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("benchmark run: %v\n%s", err, out)
	}
}

func BenchmarkPastTheTimeout(b *testing.B) {
	if os.Getenv("TESTWATCH_BENCH") != "1" {
		b.Skip("run by TestBenchmarksOutliveTheWatchdog")
	}
	for b.Loop() {
		time.Sleep(1500 * time.Millisecond) // the workload: longer than -test.timeout
	}
}

// TestACleanupIsNamedAfterItsTest: a goroutine stuck in a test's cleanup
// has no frame of the test (the cleanup is a method value, say a
// cluster's close); it is named after the test whose t.Run started it.
// The watchdog took such a dump for one with no test running, and let
// Go's timeout end the binary (the CI hang it was written for).
func TestACleanupIsNamedAfterItsTest(t *testing.T) {
	const dump = `goroutine 1 [chan receive, 14 minutes]:
testing.(*T).Run(0xc000179448, {0x176deba, 0x24}, 0x17a3348)
	/go/src/testing/testing.go:2109 +0xb3e
testing.runTests.func1(0xc000179448)
	/go/src/testing/testing.go:2585 +0x85
testing.tRunner(0xc000179448, 0xc000499928)
	/go/src/testing/testing.go:2036 +0x21d
testing.(*M).Run(0xc0001cf220)
	/go/src/testing/testing.go:2443 +0xf4c
main.main()
	_testmain.go:150 +0x172

goroutine 6258 [chan receive, 14 minutes]:
testing.(*T).Run(0xc0000d2b48, {0xc00195dabc, 0x4}, 0x17a3668)
	/go/src/testing/testing.go:2109 +0xb3e
github.com/kvrouter/kvrouter/raftfsm.TestCloseWhileABarrierWaitsForTheFSM(0xc0000d2b48)
	/w/raftfsm/leader_test.go:125 +0x93
testing.tRunner(0xc0000d2b48, 0x17a3348)
	/go/src/testing/testing.go:2036 +0x21d
created by testing.(*T).Run in goroutine 1
	/go/src/testing/testing.go:2101 +0xb13

goroutine 6602 [sync.WaitGroup.Wait, 14 minutes]:
sync.runtime_SemacquireWaitGroup(0xc001efda08?, 0x6b?)
	/go/src/runtime/sema.go:114 +0x2e
sync.(*WaitGroup).Wait(0xc001be6308)
	/go/src/sync/waitgroup.go:206 +0xc5
github.com/kvrouter/kvrouter/raftfsm.(*Node).close(0xc008cf5a00)
	/w/raftfsm/node.go:352 +0x5b
github.com/kvrouter/kvrouter/raftfsm.(*testCluster).close(0xc001949c80)
	/w/raftfsm/cluster_test.go:158 +0x11f
testing.(*common).Cleanup.func1()
	/go/src/testing/testing.go:1317 +0x169
testing.tRunner(0xc00117cd88, 0x17a3668)
	/go/src/testing/testing.go:2042 +0x256
created by testing.(*T).Run in goroutine 6258
	/go/src/testing/testing.go:2101 +0xb13`
	if got := running([]byte(dump)); !slices.Equal(got, []string{"TestCloseWhileABarrierWaitsForTheFSM (cleanup or subtest)"}) {
		t.Fatalf("running = %q", got)
	}
}

// TestTopLevelCleanupsAndDeepStacks: the cleanup of a top-level test
// runs on a goroutine the main one started, whose TestMain frame names no
// test; a stack deeper than the runtime prints holds an elided-frames
// line, after which frames still pair with their locations.
func TestTopLevelCleanupsAndDeepStacks(t *testing.T) {
	const dump = `goroutine 1 [chan receive]:
testing.(*T).Run(0xc000179448, {0x176deba, 0x24}, 0x17a3348)
	/go/src/testing/testing.go:2109 +0xb3e
github.com/kvrouter/kvrouter/raftfsm.TestMain(0xc0001cf220)
	/w/raftfsm/cluster_test.go:27 +0x3fc
main.main()
	_testmain.go:150 +0x172

goroutine 7 [semacquire]:
sync.(*WaitGroup).Wait(0xc001be6308)
	/go/src/sync/waitgroup.go:206 +0xc5
github.com/kvrouter/kvrouter/raftfsm.(*testCluster).close(0xc001949c80)
	/w/raftfsm/cluster_test.go:158 +0x11f
testing.tRunner(0xc00117cd88, 0x17a3668)
	/go/src/testing/testing.go:2042 +0x256
created by testing.(*T).Run in goroutine 1
	/go/src/testing/testing.go:2101 +0xb13

goroutine 9 [chan receive]:
github.com/kvrouter/kvrouter/raftfsm.deep(0x1)
	/w/raftfsm/x_test.go:5 +0x1
...additional frames elided...
github.com/kvrouter/kvrouter/raftfsm.TestDeep(0xc0000d2b48)
	/w/raftfsm/x_test.go:9 +0x93
testing.tRunner(0xc0000d2b48, 0x17a3348)
	/go/src/testing/testing.go:2036 +0x21d
created by testing.(*T).Run in goroutine 1
	/go/src/testing/testing.go:2101 +0xb13`
	want := []string{"a top-level test's cleanup", "TestDeep"}
	if got := running([]byte(dump)); !slices.Equal(got, want) {
		t.Fatalf("running = %q, want %q", got, want)
	}
}

func parkedInReceive(stop <-chan struct{}, parked chan<- struct{}) {
	close(parked)
	<-stop
}

// TestGoroutinesFindsAParkedGoroutine: Goroutines counts a goroutine by
// a frame and by its state, and nothing for a frame no goroutine has.
func TestGoroutinesFindsAParkedGoroutine(t *testing.T) {
	stop, parked := make(chan struct{}), make(chan struct{})
	defer close(stop)
	go parkedInReceive(stop, parked)
	<-parked
	deadline := time.Now().Add(10 * time.Second)
	for Goroutines("testwatch.parkedInReceive(", "[chan receive") == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no goroutine parked in parkedInReceive after 10s:\n%s", dump())
		}
		runtime.Gosched()
	}
	if n := Goroutines("testwatch.noSuchFunction(", ""); n != 0 {
		t.Fatalf("%d goroutines in a function that does not exist", n)
	}
}

// testingM is a goleak.TestingM whose Run is run.
type testingM func() int

func (m testingM) Run() int { return m() }

// TestSettledWaitsForGoroutinesThatEndLate: a goroutine that outlives the
// last test by longer than goleak's own wait (about 0.4 s) but ends
// within LeakGrace is not reported; one that outlives the grace still is;
// a failed run is not held up.
func TestSettledWaitsForGoroutinesThatEndLate(t *testing.T) {
	defer func(g time.Duration) { LeakGrace = g }(LeakGrace)
	passed := testingM(func() int { return 0 })

	// Ends a second and a half after Settled's Run starts: past
	// goleak's own wait.
	late := make(chan struct{})
	go lingerUntil(late)
	if err := goleak.Find(); err == nil {
		t.Fatal("goleak.Find found no goroutine while one lingers: the test shows nothing")
	}
	LeakGrace = time.Minute
	time.AfterFunc(1500*time.Millisecond, func() { close(late) })
	if code := Settled(passed).Run(); code != 0 {
		t.Fatalf("Settled(passed).Run() = %d, want 0", code)
	}
	if err := goleak.Find(); err != nil {
		t.Fatalf("after Settled's Run, a goroutine that ended late is still found: %v", err)
	}

	// Outlives the grace: still there for VerifyTestMain to report.
	stuck := make(chan struct{})
	defer close(stuck)
	go lingerUntil(stuck)
	LeakGrace = 300 * time.Millisecond
	if code := Settled(passed).Run(); code != 0 {
		t.Fatalf("Settled(passed).Run() = %d, want 0: the leak is VerifyTestMain's to report", code)
	}
	if err := goleak.Find(); err == nil || !strings.Contains(err.Error(), "lingerUntil") {
		t.Fatalf("after the grace, goleak.Find = %v; want the stuck goroutine found", err)
	}

	// A failed run returns its code at once, whatever lingers.
	LeakGrace = time.Hour
	done := make(chan int, 1)
	go func() { done <- Settled(testingM(func() int { return 3 })).Run() }()
	if code := Within(t, 30*time.Second, done, "Settled's Run of a failed run"); code != 3 {
		t.Fatalf("Settled(failed).Run() = %d, want 3", code)
	}
}

func lingerUntil(c <-chan struct{}) { <-c }

// TestSettledHonoursItsOptions: a goroutine the options tell goleak to
// ignore, still running after the last test, is not waited for: Settled's
// Run returns without the grace (here an hour). A Run that called
// goleak.Find without the options waited the whole grace in every package
// whose tests leave goroutines behind by design (NodeIgnores), and passed
// every other test. Run runs on the test's goroutine, which goleak.Find
// leaves out, as it does TestMain's; past a deadline a timer ends the
// goroutine, so that a Run that waits for it returns, and the test fails.
func TestSettledHonoursItsOptions(t *testing.T) {
	defer func(g time.Duration) { LeakGrace = g }(LeakGrace)
	stop := make(chan struct{})
	go ignoredLinger(stop)
	ignore := goleak.IgnoreAnyFunction("github.com/kvrouter/kvrouter/internal/testwatch.ignoredLinger")
	if err := goleak.Find(); err == nil || !strings.Contains(err.Error(), "ignoredLinger") {
		close(stop)
		t.Fatalf("goleak.Find without the option = %v; want the lingering goroutine found: the test shows nothing", err)
	}
	LeakGrace = time.Hour
	deadline := time.AfterFunc(30*time.Second, func() { close(stop) })
	code := Settled(testingM(func() int { return 0 }), ignore).Run()
	if !deadline.Stop() {
		t.Fatal("Settled's Run waited for a goroutine its options ignore, until the test's 30 s deadline ended it")
	}
	close(stop)
	if code != 0 {
		t.Fatalf("Settled(passed, ignore).Run() = %d, want 0", code)
	}
}

func ignoredLinger(c <-chan struct{}) { <-c }
