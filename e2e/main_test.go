package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"go.uber.org/goleak"
)

var seedFlag = flag.Uint64("seed", 0, "seed of the random event streams (0: a new one per test, logged)")

// Paths of the binaries TestMain builds.
var (
	kvrouterBin string
	kvctlBin    string
	kvagentBin  string
)

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "kvrouter-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	if err := buildBinaries(dir); err != nil {
		os.RemoveAll(dir)
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	kvrouterBin, kvctlBin, kvagentBin = filepath.Join(dir, "kvrouter"), filepath.Join(dir, "kvctl"), filepath.Join(dir, "kvagent")
	testwatch.Start() // after the build: -test.timeout counts from m.Run
	// goleak.VerifyTestMain exits the process, so the binaries are removed
	// by the cleanup option rather than after it returns.
	goleak.VerifyTestMain(testwatch.Settled(m), goleak.Cleanup(func(code int) {
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}

// buildBinaries builds kvrouter, kvctl and kvagent into dir, once for the whole run.
// The race detector stays off whatever GOFLAGS says: it would make the
// daemons several times slower, and the daemons' own packages have their
// race-enabled tests.
func buildBinaries(dir string) error {
	// go test puts its own GOROOT/bin first on the test's PATH.
	goBin, err := exec.LookPath("go")
	if err != nil {
		return fmt.Errorf("find the go command to build the binaries: %w", err)
	}
	start := time.Now()
	cmd := exec.Command(goBin, "build", "-race=false", "-o", dir+string(filepath.Separator),
		"github.com/kvrouter/kvrouter/cmd/kvrouter", "github.com/kvrouter/kvrouter/cmd/kvctl",
		"github.com/kvrouter/kvrouter/cmd/kvagent")
	// The environment is the test's own, CGO_CFLAGS included, so that the
	// build reuses what `go build` and `make` put in the build cache.
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go build kvrouter kvctl kvagent: %v\n%s", err, strings.TrimSpace(string(out)))
	}
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, "e2e: built kvrouter, kvctl and kvagent in %v\n", time.Since(start).Round(time.Millisecond))
	}
	return nil
}
