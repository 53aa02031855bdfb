package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
)

// TestEveryFlagHasAnEnvVar: every kvrouter flag is read from KVROUTER_<FLAG>
// too (docs/operations.md; the design's cli.md), as kvagent's are from
// KVAGENT_<FLAG>.
func TestEveryFlagHasAnEnvVar(t *testing.T) {
	for _, bad := range clihelp.EnvVarMismatches(newApp().Flags, "KVROUTER") {
		t.Error(bad)
	}
}

// TestWithoutDataDirTheStateIsInDataAndTheListenLineIsInfo: kvrouter
// with no --data-dir keeps its state in ./data (cli.md: "with no flags
// kvrouter uses ./data"), and logs where it listens at Info, the
// default --log-level: the "kvrouter listening" line names the HTTP URL
// and the data directory.
func TestWithoutDataDirTheStateIsInDataAndTheListenLineIsInfo(t *testing.T) {
	clearFlagEnv(t)
	dir := t.TempDir()
	t.Chdir(dir)
	var httpAddr string
	logged := stderrOf(t, func() {
		ctx, cancel := context.WithCancel(context.Background())
		done := startNode(t, ctx, func() []string {
			httpAddr = freeAddr(t)
			return []string{"--http-addr", httpAddr, "--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0"}
		}, func() bool { return answersReady(httpAddr) })
		cancel()
		if err := <-done; err != nil {
			t.Errorf("kvrouter stopped with %v", err)
		}
	})
	if fi, err := os.Stat(filepath.Join(dir, "data")); err != nil || !fi.IsDir() {
		t.Errorf("kvrouter without --data-dir: no ./data (%v)", err)
	}
	for _, line := range strings.Split(logged, "\n") {
		if strings.Contains(line, "level=INFO") && strings.Contains(line, `msg="kvrouter listening"`) &&
			strings.Contains(line, "http=http://"+httpAddr) && strings.Contains(line, "data_dir=data") {
			return
		}
	}
	t.Errorf("no Info line \"kvrouter listening\" naming http://%s and data_dir=data in the log:\n%s", httpAddr, logged)
}
