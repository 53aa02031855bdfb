package pool

import (
	"errors"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// From a second review: on a healthy disk under heavy writes (4 writers of
// 512-byte blocks, inline in the sstables so that each compaction of L0
// rewrites them) compactions lag behind the flushes, and nothing bounded
// L0 but Pebble's stall, raised to 1000: 85 sublevels in 25 s, reads 20 to
// 30 % slower. Puts are now refused at l0Refuse sublevels whatever the
// cause: L0 stays within l0Refuse and the Puts in flight, and a refused
// Put goes through once compactions have caught up (none is refused for
// ever on a healthy disk).
func TestL0StaysShallowUnderConcurrentWritersOnAHealthyDisk(t *testing.T) {
	const (
		bs      = 512
		writers = 4
		puts    = 150 // per writer
	)
	var log testlog.Buffer
	p, err := OpenDisk(filepath.Join(t.TempDir(), "pool"), Config{Capacity: 1 << 16, BlockSize: bs, Sink: &orderSink{},
		Logger: slog.New(slog.NewTextHandler(&log, nil))}, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })

	var (
		mu       sync.Mutex
		deepest  int
		refused  int
		firstErr error
	)
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bs)
			for i := 0; i < puts; i++ {
				blocks := make([]Block, 16)
				data := make([][]byte, 16)
				for j := range blocks {
					h := uint64(w*puts*16+i*16+j) + 1
					blocks[j] = Block{Hash: h * 0x9e3779b97f4a7c15, Local: h}
					data[j] = buf
				}
				// A refused Put is retried until it goes through: on a
				// healthy disk compactions bring L0 under l0Refuse.
				deadline := time.Now().Add(time.Minute)
				for {
					_, err := p.Put(blocks, data)
					d := p.l0Sublevels()
					mu.Lock()
					deepest = max(deepest, d)
					if err != nil && errors.Is(err, ErrL0Deep) {
						refused++
					} else if err != nil && firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					if err == nil || !errors.Is(err, ErrL0Deep) {
						break
					}
					if time.Now().After(deadline) {
						mu.Lock()
						if firstErr == nil {
							firstErr = errors.New("a Put was still refused a minute after its first try: " + err.Error())
						}
						mu.Unlock()
						return
					}
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		t.Fatalf("%v\nlog:\n%s", firstErr, log.String())
	}
	if deepest > l0Refuse+writers {
		t.Fatalf("L0 reached %d sublevels with %d writers (%d Puts refused, each retried), want at most %d "+
			"(l0Refuse and the Puts in flight)", deepest, writers, refused, l0Refuse+writers)
	}
	t.Logf("L0 at most %d sublevels; %d Puts refused and retried", deepest, refused)
}
