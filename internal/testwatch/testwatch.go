// Package testwatch names the tests that hang. A test binary killed by its
// -test.timeout prints every goroutine's stack, and the name of the test
// that hung comes first, far above the end of the output, which is all a
// CI log may keep. Start arms a watchdog that fires a little before that
// timeout: if a test is still running then, it prints the goroutine dump,
// then, last, one short entry per test goroutine (the test, its state, and
// the frames of this module it is blocked in), and exits the binary with
// status 2, where Go would have killed it a few seconds later anyway.
//
// The watchdog only reads: it changes no test's behaviour, and with no
// test running (benchmarks and fuzzing, which Go's timeout does not cover
// either) it does nothing. Within is the bounded wait for a test's own
// goroutines that keeps a failed one from hanging the binary.
package testwatch

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"
)

// module is the import path prefix of this project's frames.
const module = "github.com/kvrouter/kvrouter/"

// Start arms the watchdog for the binary's -test.timeout (parsing the
// flags if TestMain has not). It fires at the timeout less a twentieth of
// it, at most 10 s. It does nothing when the timeout is off, and in a
// fuzzing worker. Call it just before m.Run: Go's timeout counts from
// there.
func Start() {
	if !flag.Parsed() {
		flag.Parse()
	}
	if f := flag.Lookup("test.fuzzworker"); f != nil && f.Value.String() == "true" {
		return
	}
	f := flag.Lookup("test.timeout")
	if f == nil {
		return
	}
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return
	}
	timeout, _ := g.Get().(time.Duration)
	if timeout <= 0 {
		return
	}
	margin := min(timeout/20, 10*time.Second)
	start := time.Now()
	time.AfterFunc(timeout-margin, func() {
		stacks := dump()
		if len(running(stacks)) == 0 {
			return // benchmarks or fuzzing: past Go's timeout too
		}
		Report(os.Stderr, stacks, time.Since(start))
		os.Exit(2)
	})
}

// Main is the TestMain of a package that needs nothing else: Start, then
// the tests.
func Main(m *testing.M) {
	Start()
	os.Exit(m.Run())
}

// dump returns every goroutine's stack.
func dump() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// testFrame matches a frame of a test function or of a closure in one.
var testFrame = regexp.MustCompile(`\.((?:Test|Fuzz|Example)[A-Za-z0-9_]*)(?:\.func[0-9.]+)?\(`)

// Report writes the dump, then one entry per test goroutine, then a line
// naming the running tests: the part a truncated log keeps comes last.
func Report(w io.Writer, stacks []byte, after time.Duration) {
	fmt.Fprintf(w, "testwatch: still running after %v, near -test.timeout; all goroutines:\n\n", after.Round(time.Second))
	w.Write(stacks)
	var names []string
	fmt.Fprintf(w, "\ntestwatch: the test goroutines, each with its state and the frames of this module it is in (innermost first):\n")
	for _, e := range tests(stacks) {
		names = append(names, e.test)
		fmt.Fprintf(w, "  %s [%s]: %s\n", e.test, e.state, strings.Join(e.frames, " <- "))
	}
	fmt.Fprintf(w, "testwatch: running tests: %s\n", strings.Join(names, ", "))
}

// running names the tests the dump shows running.
func running(stacks []byte) []string {
	var names []string
	for _, e := range tests(stacks) {
		names = append(names, e.test)
	}
	return names
}

type entry struct {
	test, state string
	frames      []string // "pkg.Func file.go:N"
	runner      bool     // runs a test, a subtest or a test's cleanup
	parentWait  bool     // a test waiting for its subtests
	main        bool     // the main goroutine (TestMain, the test runner)
	createdBy   string   // the id of the goroutine that started it
}

// tests returns the entries of the goroutines that run a test, in the
// dump's order. One with no test frame of its own (a test's cleanup, say
// a cluster's close) is named after the test of the goroutine that started
// it, with " (cleanup or subtest)".
func tests(stacks []byte) []entry {
	byID := map[string]entry{}
	var order []string
	for _, g := range bytes.Split(stacks, []byte("\n\n")) {
		id, e := summarize(string(g))
		if id != "" {
			byID[id] = e
			order = append(order, id)
		}
	}
	var out []entry
	for _, id := range order {
		e := byID[id]
		if !e.runner || e.parentWait {
			continue
		}
		if e.test == "" {
			// The dump does not name a top-level test whose own goroutine
			// runs its cleanup: the goroutine that started it is the
			// main one.
			e.test = "a top-level test's cleanup"
			for p, hops := e.createdBy, 0; p != "" && hops < 8; hops++ {
				pe, ok := byID[p]
				if !ok || pe.main {
					break
				}
				if pe.test != "" {
					e.test = pe.test + " (cleanup or subtest)"
					break
				}
				p = pe.createdBy
			}
		}
		out = append(out, e)
	}
	return out
}

// createdIn matches the last line pair's "created by F in goroutine N".
var createdIn = regexp.MustCompile(`in goroutine ([0-9]+)$`)

// summarize reads one goroutine's block of a dump: its id ("" when the
// block is none) and its entry.
func summarize(g string) (string, entry) {
	lines := strings.Split(strings.TrimSpace(g), "\n")
	if len(lines) < 3 || !strings.HasPrefix(lines[0], "goroutine ") {
		return "", entry{}
	}
	id, _, _ := strings.Cut(strings.TrimPrefix(lines[0], "goroutine "), " ")
	var e entry
	if i, j := strings.IndexByte(lines[0], '['), strings.LastIndexByte(lines[0], ']'); i >= 0 && j > i {
		e.state = lines[0][i+1 : j]
	}
	e.main = strings.Contains(g, "\nmain.main()")
	e.runner = strings.Contains(g, "testing.tRunner(") && !e.main
	e.parentWait = strings.HasPrefix(lines[1], "testing.(*T).Run(")
	// A frame is a function line then its tab-indented location line; a
	// deep stack also holds a "...N frames elided..." line of its own.
	for k, nth := 1, 0; k < len(lines); k++ {
		fn := lines[k]
		if strings.HasPrefix(fn, "\t") || strings.HasPrefix(fn, "...") {
			continue
		}
		loc := ""
		if k+1 < len(lines) && strings.HasPrefix(lines[k+1], "\t") {
			loc = strings.TrimSpace(lines[k+1])
		}
		nth++
		if strings.HasPrefix(fn, "created by ") {
			if m := createdIn.FindStringSubmatch(fn); m != nil {
				e.createdBy = m[1]
			}
			break
		}
		if m := testFrame.FindStringSubmatch(fn); m != nil && strings.HasPrefix(fn, module) && e.test == "" && m[1] != "TestMain" {
			e.test = m[1]
		}
		if !strings.HasPrefix(fn, module) && nth > 2 {
			continue // the two innermost frames, then only ours
		}
		if p := strings.LastIndexByte(fn, '('); p > 0 {
			fn = fn[:p]
		}
		fn = strings.TrimPrefix(fn, module)
		if sp := strings.IndexByte(loc, ' '); sp > 0 {
			loc = loc[:sp]
		}
		e.frames = append(e.frames, fn+" "+loc[strings.LastIndexByte(loc, '/')+1:])
	}
	return id, e
}

// Within returns what ch brings, failing the test when nothing comes
// within d: the wait for a goroutine of the test that may have failed
// before it could send.
func Within[T any](t testing.TB, d time.Duration, ch <-chan T, what string) T {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("timed out after %v waiting for %s", d, what)
		panic("unreachable")
	}
}

// Goroutines counts the goroutines with a frame of function fn (a
// fragment of the stack's text, such as "pkg.(*T).M(") whose state begins
// with state ("" for any; "[select", "[sync.Mutex.Lock"): how a test
// awaits a goroutine reaching a blocking point it cannot signal from.
func Goroutines(fn, state string) int {
	count := 0
	for _, g := range strings.Split(string(dump()), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(g, fn) && strings.Contains(header, " "+state) {
			count++
		}
	}
	return count
}
