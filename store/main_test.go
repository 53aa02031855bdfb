package store

import (
	"errors"
	"log/slog"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// Every test in the package must leave no goroutine behind: a Pebble DB or a
// raft node that outlives its test is a leak here, not noise.
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}

// logStoreTestLogger writes warnings and errors to the test's output.
func logStoreTestLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// openTestLogStore opens a store in dir on fs and closes it when the test ends
// (unless the test already did).
func openTestLogStore(t testing.TB, fs vfs.FS, dir string) *LogStore {
	t.Helper()
	s, err := OpenLogStore(dir, LogStoreOptions{FS: fs, Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatalf("open log store: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil && !errors.Is(err, ErrClosed) {
			t.Errorf("close log store: %v", err)
		}
	})
	return s
}
