package store

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwatch"
)

// TestEachReadsInParts: a view cut into many parts, with an uncommitted
// group laid over it (new keys, replaced and deleted committed keys, in
// every part), reads every record once and in key order; fn's error ends
// Each with that error; a second Each beside a running one is refused.
func TestEachReadsInParts(t *testing.T) {
	smallViewReads(t, 16)
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	model := map[string]string{}
	put := func(b *StateBatch, kind byte, k, v string) {
		b.Put(kind, []byte(k), []byte(v))
		model[string(kind)+k] = v
	}
	for g := range 3 {
		b := s.NewBatch()
		for i := range 40 {
			put(b, groupTestKinds[i%len(groupTestKinds)], fmt.Sprintf("k%03d-%d", i, g), "committed")
		}
		if err := b.Commit(); err != nil {
			t.Fatal(err)
		}
		b.Close()
	}
	b := s.NewBatch()
	defer b.Close()
	for i := range 40 {
		kind := groupTestKinds[i%len(groupTestKinds)]
		switch i % 3 {
		case 0:
			put(b, kind, fmt.Sprintf("k%03d-%d", i, 1), "replaced")
		case 1:
			b.Delete(kind, fmt.Appendf(nil, "k%03d-%d", i, 2))
			delete(model, string(kind)+fmt.Sprintf("k%03d-%d", i, 2))
		case 2:
			put(b, kind, fmt.Sprintf("k%03d-new", i), "new")
		}
	}
	v := b.View()
	defer v.Close()

	s.viewMu.Lock()
	parts := v.parts([]byte{KindApplied}, []byte{kindEnd})
	s.viewMu.Unlock()
	if len(parts) < 2 || len(parts) > viewMaxParts+1 {
		t.Fatalf("view cut into %d parts, want 2 to %d", len(parts), viewMaxParts+1)
	}
	overlaid := 0
	for i, p := range parts {
		if i > 0 && !bytes.Equal(p.lo, parts[i-1].hi) {
			t.Fatalf("part %d starts at %q, the one before ends at %q", i, p.lo, parts[i-1].hi)
		}
		for rest := p.over; len(rest) > 0; {
			k, _, _, r := nextGathered(rest)
			if bytes.Compare(k, p.lo) < 0 || bytes.Compare(k, p.hi) >= 0 {
				t.Fatalf("part %d [%q, %q) has the overlay's %q", i, p.lo, p.hi, k)
			}
			rest = r
			overlaid++
		}
	}
	if overlaid != 40 {
		t.Fatalf("parts hold %d of the overlay's 40 writes", overlaid)
	}

	got := map[string]string{}
	var last []byte
	inner := errors.New("unset")
	if err := v.Each(func(k, val []byte) error {
		if last != nil && bytes.Compare(k, last) <= 0 {
			t.Fatalf("view out of order: %q after %q", k, last)
		}
		last = append(last[:0], k...)
		got[string(k)] = string(val)
		if inner != nil && len(got) == 1 {
			inner = v.Each(func(_, _ []byte) error { return nil })
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, model) {
		t.Fatalf("view holds %d records, model %d:\n%v\n%v", len(got), len(model), got, model)
	}
	if !errors.Is(inner, errViewReading) {
		t.Fatalf("an Each inside a running one returned %v, want errViewReading", inner)
	}

	stop := errors.New("stop here")
	read := 0
	err = v.Each(func(_, _ []byte) error {
		if read++; read == 10 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || read != 10 {
		t.Fatalf("Each whose fn failed at the 10th record read %d and returned %v", read, err)
	}
	// The view reads again after a failed Each.
	n := 0
	if err := v.Each(func(_, _ []byte) error { n++; return nil }); err != nil || n != len(model) {
		t.Fatalf("Each after a failed one: %d records, %v; want %d", n, err, len(model))
	}
}

// TestMidKey: the key halfway between two keys lies strictly between them
// (keys that differ only in trailing zeros have none: cutRange stops there).
func TestMidKey(t *testing.T) {
	for _, c := range []struct{ lo, hi, want string }{
		{"\x01", "\x0c", "\x06\x80"},
		{"\x05", "\x06", "\x05\x80"},
		{"a", "a\x00\x01", "a\x00\x00\x80"},
		{"\x05\xff", "\x06", "\x05\xff\x80"},
		{"ab", "b", "a\xb1"},
	} {
		got := midKey([]byte(c.lo), []byte(c.hi))
		if string(got) != c.want || bytes.Compare(got, []byte(c.lo)) <= 0 || bytes.Compare(got, []byte(c.hi)) >= 0 {
			t.Errorf("midKey(%q, %q) = %q, want %q", c.lo, c.hi, got, c.want)
		}
	}
}

// TestScanRange: a range scan yields the kind's records in [from, to),
// a nil bound being the kind's end, and nothing of a neighbouring kind.
func TestScanRange(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b := s.NewBatch()
	defer b.Close()
	for _, k := range []string{"\x00", "\x7f\xff", "\x80", "\x80\x00", "\xff"} {
		b.Put(KindBooking, []byte(k), []byte("v"))
		b.Put(KindTomb, []byte(k), []byte("other kind"))
		b.Put(KindWorker, []byte(k), []byte("other kind"))
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		from, to []byte
		want     string
	}{
		{nil, nil, "00 7fff 80 8000 ff"},
		{nil, []byte{0x80}, "00 7fff"},
		{[]byte{0x80}, nil, "80 8000 ff"},
		{[]byte{0x7f}, []byte{0x80, 0x00}, "7fff 80"},
	} {
		var got []string
		if err := s.ScanRange(KindBooking, c.from, c.to, func(k, v []byte) error {
			if string(v) != "v" {
				t.Fatalf("range [%x, %x) yields %q of another kind", c.from, c.to, v)
			}
			got = append(got, fmt.Sprintf("%x", k))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if g := strings.Join(got, " "); g != c.want {
			t.Errorf("range [%x, %x): %s, want %s", c.from, c.to, g, c.want)
		}
	}
}

// TestEachAcrossACloseBeforeTheFirstRead: the database closes (a restore
// swapping it) after a reader opened its iterator and before it read
// anything; Each fails with ErrClosed instead of reading through a closed
// iterator (that crashed in Pebble).
func TestEachAcrossACloseBeforeTheFirstRead(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := s.NewBatch()
	for i := range 100 {
		b.Put(KindBooking, fmt.Appendf(nil, "k%03d", i), []byte("v"))
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	b.Close()
	v := s.Snapshot()
	closed := false
	viewReaderOpened = func() {
		if !closed {
			closed = true
			if err := s.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		}
	}
	defer func() { viewReaderOpened = nil }()
	read := 0
	err = v.Each(func(_, _ []byte) error { read++; return nil })
	if !errors.Is(err, ErrClosed) || read != 0 || !closed {
		t.Fatalf("Each across a close before its first read: %d records, %v (closed %v); want ErrClosed", read, err, closed)
	}
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestCloseWhileAReaderClosesItsIterator: a reader done with its part
// forgets its iterator and closes it as one step under the views' lock,
// so a StateDB.Close (a restore swapping the database) cannot run in
// between, find no iterator to close, and close Pebble under an open one
// ("leaked iterators"). The hook starts the Close at that point and waits
// until Close either returns (it did not wait for the reader: fail) or is
// seen blocked on a mutex (the goroutine dump shows StateDB.Close in
// sync.Mutex.Lock), then lets the reader finish.
func TestCloseWhileAReaderClosesItsIterator(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := s.NewBatch()
	for i := range 10 {
		b.Put(KindBooking, fmt.Appendf(nil, "k%03d", i), []byte("v"))
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	b.Close()
	v := s.Snapshot()
	closed := make(chan error, 1)
	started := false
	viewIterForgotten = func() {
		if started {
			return
		}
		started = true
		go func() { closed <- s.Close() }()
		deadline := time.Now().Add(20 * time.Second)
		for !closeBlocked() {
			select {
			case err := <-closed:
				t.Errorf("Close returned (%v) while a reader was closing its iterator: it did not wait", err)
				closed <- err
				return
			default:
			}
			if time.Now().After(deadline) {
				t.Errorf("Close neither returned nor blocked in 20 s")
				return
			}
			runtime.Gosched()
		}
	}
	defer func() { viewIterForgotten = nil }()
	_ = v.Each(func(_, _ []byte) error { return nil }) // ErrClosed or nil: the close races the rest
	if !started {
		t.Fatal("no reader finished a part")
	}
	if err := <-closed; err != nil {
		t.Fatalf("close while a reader closed its iterator: %v", err)
	}
}

// closeBlocked reports whether a goroutine is blocked in sync.Mutex.Lock
// inside StateDB.Close.
func closeBlocked() bool {
	return testwatch.Goroutines("store.(*StateDB).Close(", "[sync.Mutex.Lock") > 0
}

// TestEachWhoseFnPanicsStopsItsReaders: a panic in fn (which a caller such
// as net/http recovers) still stops Each's readers: none is left blocked
// with its iterator open, and the view can be read again.
func TestEachWhoseFnPanicsStopsItsReaders(t *testing.T) {
	smallViewReads(t, 16)
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b := s.NewBatch()
	defer b.Close()
	for i := range 200 {
		b.Put(groupTestKinds[i%len(groupTestKinds)], fmt.Appendf(nil, "k%03d", i), []byte("v"))
	}
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	v := s.NewBatch().View()
	defer v.Close()
	before := runtime.NumGoroutine()
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("fn's panic did not reach the caller")
			}
		}()
		_ = v.Each(func(_, _ []byte) error { panic("fn fails") })
	}()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after the panic, %d before: the readers were left running", runtime.NumGoroutine(), before)
		}
		time.Sleep(time.Millisecond)
	}
	n := 0
	if err := v.Each(func(_, _ []byte) error { n++; return nil }); err != nil || n < 200 {
		t.Fatalf("Each after the panic: %d records, %v", n, err)
	}
}
