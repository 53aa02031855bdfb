package indexer

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// No test may leave a goroutine behind: the index starts none, and the
// tests that read beside writers (or build in parallel) must stop theirs.
func TestMain(m *testing.M) { goleak.VerifyTestMain(testwatch.Settled(m)) }
