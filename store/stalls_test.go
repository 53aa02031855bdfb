package store

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
)

// gateFS holds back the creation of tables (flushes) until open.
type gateFS struct {
	vfs.FS
	open chan struct{}
}

func (g gateFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	if strings.HasSuffix(name, ".sst") {
		<-g.open
	}
	return g.FS.Create(name, c)
}

// TestWriteStallsAreCounted: writes held back while memtables wait for a
// flush that cannot run count as stalled time, which stops when the flush
// goes through.
func TestWriteStallsAreCounted(t *testing.T) {
	fs := gateFS{FS: vfs.NewMem(), open: make(chan struct{})}
	var stalls WriteStalls
	s, err := OpenLogStore("db", LogStoreOptions{FS: fs, Logger: logStoreTestLogger(t), Stalls: &stalls, CacheBytes: -1,
		tune: func(o *pebble.Options) {
			o.MemTableSize = 1 << 20
			o.MemTableStopWritesThreshold = 2
		}})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() { once.Do(func() { close(fs.open) }) }
	defer release()
	done := make(chan error, 1)
	go func() {
		value := make([]byte, 64<<10)
		for i := uint64(1); i <= 200; i++ { // 12.5 MiB: far past two 1 MiB memtables
			if err := s.StoreLog(&raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: value}); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	deadline := time.Now().Add(30 * time.Second)
	for stalls.Count() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no write stall while the flushes are held back")
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("the writes finished during a stall: %v", err)
	default:
	}
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if stalls.Seconds() <= 0 {
		t.Fatalf("stalled %v s", stalls.Seconds())
	}
	first := stalls.Seconds()
	if again := stalls.Seconds(); again != first {
		t.Fatalf("the stalled time grows after the stall ended: %v then %v", first, again)
	}
}

// TestStallEndsWithItsDatabase: a stall still in progress when its
// database closes ends there; the count does not grow for ever after.
func TestStallEndsWithItsDatabase(t *testing.T) {
	var w WriteStalls
	w.begin(time.Now())
	w.closed()
	first := w.Seconds()
	if again := w.Seconds(); again != first {
		t.Fatalf("a closed database's stall goes on: %v then %v", first, again)
	}
}
