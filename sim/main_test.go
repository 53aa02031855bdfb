package sim

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// A test that hangs is named at the end of the output (testwatch), and
// none may leave a goroutine behind (publishers serve replays, the live
// replay runs subscribers).
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}
