package netproxy

import (
	"testing"

	"go.uber.org/goleak"
)

// Every test closes its proxies and targets: no goroutine may outlive them.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
