package testwatch

import (
	"fmt"
	"os"
	"time"

	"go.uber.org/goleak"
)

// NodeIgnores are the goroutines that outlive a closed node by design,
// for goleak in the packages whose tests run nodes (raftfsm.Node, its
// Pebble databases and Raft transport) in-process:
// goleak.VerifyTestMain(m, testwatch.NodeIgnores()...).
func NodeIgnores() []goleak.Option {
	return []goleak.Option{
		// raftfsm.Node.await's waiter on a future Raft dropped at shutdown.
		goleak.IgnoreAnyFunction("github.com/kvrouter/kvrouter/raftfsm.awaitFuture"),
		// Pebble's background goroutines that outlive a closed DB.
		goleak.IgnoreTopFunction("github.com/cockroachdb/pebble/v2/internal/cache.(*shard).releaseLoop"),
		goleak.IgnoreAnyFunction("github.com/cockroachdb/pebble/v2.(*tableCacheShard).releaseLoop"),
		// raft's NetworkTransport does not track the connections it
		// accepted: Close stops the listener, and each handleConn goroutine
		// ends only when its peer closes the connection, which can be just
		// after the last test returns.
		goleak.IgnoreAnyFunction("github.com/hashicorp/raft.(*NetworkTransport).handleConn"),
	}
}

// LeakGrace is how long Settled waits, after the last test, for the
// goroutines the tests started to end.
var LeakGrace = 20 * time.Second

// Settled wraps a package's testing.M for goleak.VerifyTestMain, whose
// own check of the goroutines left gives them about 0.4 s (twenty tries,
// the last three 100 ms apart) to end after the last test: on a loaded
// two-core -race run a goroutine a test's Close let go (a connection's
// reader that sees its EOF, a server's handler returning) can take
// longer to be scheduled and return, and the whole package then fails
// with "found unexpected goroutines" and no test to blame. Its Run runs
// the tests and, where they passed, waits up to LeakGrace until
// goleak.Find, given opts, finds none; VerifyTestMain's check then runs
// as before, and a goroutine that outlives the grace is still the leak it
// reports. A wait past goleak's own is said on stderr with how long it
// took, so that a Close that lets go of its goroutines too slowly shows.
//
//	goleak.VerifyTestMain(testwatch.Settled(m, opts...), opts...)
//
// opts must not hold goleak.Cleanup, which goleak.Find refuses: give that
// to VerifyTestMain alone.
func Settled(m goleak.TestingM, opts ...goleak.Option) goleak.TestingM {
	return settled{m: m, opts: opts}
}

type settled struct {
	m    goleak.TestingM
	opts []goleak.Option
}

func (s settled) Run() int {
	code := s.m.Run()
	if code != 0 {
		return code
	}
	start := time.Now()
	for tries := 0; ; tries++ {
		err := goleak.Find(s.opts...)
		if err == nil {
			if tries > 0 {
				fmt.Fprintf(os.Stderr, "testwatch: the tests' goroutines ended %v after the last test\n", time.Since(start).Round(time.Millisecond))
			}
			return code
		}
		if time.Since(start) >= LeakGrace {
			return code // VerifyTestMain's own check reports them
		}
		time.Sleep(100 * time.Millisecond)
	}
}
