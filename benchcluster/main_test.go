package benchcluster

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

// A test that hangs is named at the end of the output (testwatch), and
// none may leave a goroutine behind (the route benchmark serves HTTP and
// runs a load generator, the failover test its writers).
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}
