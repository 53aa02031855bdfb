package enginepub

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
)

// A test that hangs is named at the end of the output (testwatch).
func TestMain(m *testing.M) { testwatch.Main(m) }
