package netproxy

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// Every test closes its proxies and targets: no goroutine may outlive them.
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}
