package enginesub

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// Every test stops what it starts: subscribers, their sockets, the Python
// publishers and the goroutines that read them.
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}
