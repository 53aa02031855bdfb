package store

import (
	"log/slog"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// WriteStalls adds up the time Pebble held a database's writers back (a
// write stall: too many memtables waiting for their flush, or too many
// level 0 sublevels) for kvrouter_store_write_stall_seconds_total. One may
// be shared by the databases that follow each other in one role: a
// restore swaps the state database, and the count goes on. The zero value
// is ready for use.
type WriteStalls struct {
	mu     sync.Mutex
	total  time.Duration
	since  time.Time // the stall in progress began; zero when none
	stalls uint64
	logged time.Time // the last stall logged as a warning
}

// Seconds returns the stalled time so far, a stall in progress included.
func (w *WriteStalls) Seconds() float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	d := w.total
	if !w.since.IsZero() {
		d += time.Since(w.since)
	}
	return d.Seconds()
}

// Count returns how many stalls began.
func (w *WriteStalls) Count() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stalls
}

// begin notes a stall that began at now; it reports whether to log it as
// a warning (at most one every stallLogEvery).
func (w *WriteStalls) begin(now time.Time) (warn bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.since.IsZero() {
		w.since = now
		w.stalls++
	}
	if now.Sub(w.logged) < stallLogEvery {
		return false
	}
	w.logged = now
	return true
}

// stallLogEvery spaces the warnings of a database that stalls over and
// over (each stall is short, and they come by the hundred).
const stallLogEvery = 10 * time.Second

// closed ends a stall in progress when its database closes (Pebble says
// nothing more of it then).
func (w *WriteStalls) closed() {
	if w != nil {
		w.end(time.Now())
	}
}

func (w *WriteStalls) end(now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.since.IsZero() {
		w.total += now.Sub(w.since)
		w.since = time.Time{}
	}
}

// listen makes opts report its write stalls to w (when w is set) and to
// the log: a stall holds every Raft append or group commit back.
func (w *WriteStalls) listen(opts *pebble.Options, logger *slog.Logger) {
	if w == nil {
		return
	}
	opts.EventListener = &pebble.EventListener{
		WriteStallBegin: func(info pebble.WriteStallBeginInfo) {
			if w.begin(time.Now()) {
				logger.Warn("pebble write stall: writes wait for a flush or compaction", "reason", info.Reason,
					"stalls", w.Count(), "stalled_seconds", w.Seconds(), "metric", "kvrouter_store_write_stall_seconds_total")
			}
		},
		WriteStallEnd: func() { w.end(time.Now()) },
	}
}
