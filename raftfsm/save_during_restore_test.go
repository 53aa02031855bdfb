package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// blockingWriter blocks its first Write until release is closed.
type blockingWriter struct {
	bytes.Buffer
	first   chan struct{}
	release chan struct{}
	once    sync.Once
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.first); <-w.release })
	return w.Buffer.Write(p)
}

// TestASaveCutOffByARestoreSaysSo: a save streaming from the leader when
// an online restore replaces the state either completes (the old state,
// whole) or fails with an error that says the state was replaced, one to
// retry (ErrStateReplaced, or the leadership's errors); not an internal
// failure of a closed database (before: "write snapshot records: read
// view: store closed", the API's 500 internal).
func TestASaveCutOffByARestoreSaysSo(t *testing.T) {
	c := newTestCluster(t, 3, slowRestoreTimeouts)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	var small bytes.Buffer
	if _, err := l.SaveSnapshot(ctx(t), &small); err != nil {
		t.Fatal(err)
	}
	// A state of several read chunks (about 54 bytes a block, 1 MiB a chunk).
	for b := 0; b < 500; b++ {
		r := kvevent.Rank{Worker: 1, DP: uint32(b)}
		ingestRetrying(t, c, []RankBatch{{Rank: r, Events: chainEvents(r, 1, 1000, uint64(b)*100_000+1)}})
	}
	l = c.leader()
	w := &blockingWriter{first: make(chan struct{}), release: make(chan struct{})}
	saved := make(chan error, 1)
	go func() {
		_, err := l.SaveSnapshot(ctx(t), w)
		saved <- err
	}()
	select {
	case <-w.first:
	case err := <-saved:
		t.Fatalf("the save answered %v before writing", err)
	}
	_, rerr := l.RestoreSnapshot(ctx(t), bytes.NewReader(small.Bytes()))
	close(w.release)
	err := <-saved
	t.Logf("restore: %v; save: %v", rerr, err)
	if rerr != nil {
		t.Skipf("the restore did not install: %v", rerr)
	}
	if err == nil {
		if _, ierr := InspectSnapshot(bytes.NewReader(w.Bytes())); ierr != nil {
			t.Fatalf("the save answered success with a stream that does not check: %v", ierr)
		}
		return
	}
	if !errors.Is(err, ErrStateReplaced) && !errors.Is(err, ErrNoLeader) && !errors.Is(err, ErrNotLeader) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a save cut off by a restore answered %q: not a retryable error (the API's 500 internal)", err)
	}
}

// TestASaveCutOffByACloseSaysTheNodeShutDown pins what cutOff tells
// apart: a view whose database a restore closed answers ErrStateReplaced,
// one whose database the FSM's Close closed answers ErrSaveShutDown (an
// ErrShutdown: 503 shutting_down, to save again from another node or
// after the restart), not taken for a restore's, nor the closed store's
// bare error (the API's 500 internal).
func TestASaveCutOffByACloseSaysTheNodeShutDown(t *testing.T) {
	f, snap := fixtureSnapshot(t)
	v, replaced, err := f.view()
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if err := f.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	_, err = writeSnapshot(io.Discard, v)
	if err = f.cutOff(err, replaced); !errors.Is(err, ErrStateReplaced) {
		t.Fatalf("a save whose view a restore closed: %v, want %v", err, ErrStateReplaced)
	}

	v, replaced, err = f.view()
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = writeSnapshot(io.Discard, v)
	if err = f.cutOff(err, replaced); !errors.Is(err, ErrSaveShutDown) || !errors.Is(err, ErrShutdown) || errors.Is(err, ErrStateReplaced) {
		t.Fatalf("a save whose view the FSM's Close closed: %v, want %v (an %v), not %v", err, ErrSaveShutDown, ErrShutdown, ErrStateReplaced)
	}
	if msg := err.Error(); !strings.Contains(msg, "save again from another node") || !strings.Contains(msg, "restarts") {
		t.Fatalf("a save whose view the FSM's Close closed: %q, want it to say to save again from another node or after the restart", msg)
	}
}
