package store

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/hashicorp/raft"
)

// TestStoreLogsOnAFailingWALNeverSucceeds pins what the log store does when
// the disk refuses its WAL (full, or failing: replication.md, fault scenario
// 15): StoreLogs never returns nil for entries the disk did not take. Pebble
// takes a failed WAL write or sync as fatal (DB.Apply calls Logger.Fatalf,
// as its commit pipeline cannot go on), and pebbleLogger logs it and panics
// with the disk's error, so the node stops there (e2e's
// TestFollowerDiskFullExitsAndCatchesUp sees that in a real process). A
// Fatalf that returned (one that only logged) would let Apply go on and
// StoreLogs return nil: raft would take entries the disk never held as
// stored, and a follower would acknowledge them. A crash then keeps every
// entry acknowledged before the failure and all or none of the failed
// call's.
func TestStoreLogsOnAFailingWALNeverSucceeds(t *testing.T) {
	for _, c := range []struct {
		what string
		kind errorfs.OpKind
	}{
		{"write", errorfs.OpFileWrite},
		{"data sync", errorfs.OpFileSyncData}, // the WAL's sync is fdatasync
	} {
		t.Run(c.what, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			var fail, injected atomic.Bool
			fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
				if fail.Load() && op.Kind == c.kind && strings.HasSuffix(op.Path, ".log") {
					injected.Store(true)
					return errorfs.ErrInjected
				}
				return nil
			}))
			s := openTestLogStore(t, fs, "raft")
			if err := s.StoreLogs(testLogs(1, 10, 1)); err != nil {
				t.Fatal(err)
			}
			fail.Store(true)
			panicked, err := storeLogsRecovered(s, testLogs(11, 20, 1))
			if !injected.Load() {
				t.Fatalf("no WAL %s was refused: the test injected nothing", c.what)
			}
			switch {
			case panicked != nil:
				if msg := fmt.Sprint(panicked); !strings.Contains(msg, "pebble fatal") || !strings.Contains(msg, errorfs.ErrInjected.Error()) {
					t.Fatalf("StoreLogs panicked with %q, want Pebble's fatal error naming the disk's", msg)
				}
			case err == nil:
				t.Fatalf("StoreLogs with its WAL %s refused: nil", c.what)
			}
			t.Logf("StoreLogs with its WAL %s refused: error %v, panic %v", c.what, err, panicked)
			// The bounds move only after a commit that returned.
			mustBounds(t, s, 1, 10)

			// A crash now (what the panic ends in) keeps entries 1..10;
			// the failed call's are all there or none is.
			crashed := mem.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: 0})
			fail.Store(false)
			s.Close() // its error is the WAL's; the DB is closed all the same
			r := openTestLogStore(t, crashed, "raft")
			last, err := r.LastIndex()
			if err != nil {
				t.Fatal(err)
			}
			if last != 10 && last != 20 {
				t.Fatalf("after the crash LastIndex = %d, want 10 (the failed call's entries gone) or 20 (all kept)", last)
			}
			for _, l := range testLogs(1, last, 1) {
				mustHave(t, r, l)
			}
			// The log goes on from there.
			if err := r.StoreLogs(testLogs(last+1, last+5, 2)); err != nil {
				t.Fatal(err)
			}
			mustBounds(t, r, 1, last+5)
		})
	}
}

// storeLogsRecovered calls StoreLogs and returns what it panicked with,
// or its error.
func storeLogsRecovered(s *LogStore, logs []*raft.Log) (panicked any, err error) {
	defer func() { panicked = recover() }()
	return nil, s.StoreLogs(logs)
}
