package e2e

import (
	"net"
	"os"
	"strings"
	"testing"
)

// TestPortTakenIsAClearStartupError: a node whose HTTP or Raft port is
// taken exits at once with one line naming the address, rather than
// running half-started; the harness then starts the cluster again on
// other ports, which the other tests rely on when a port they were given
// is grabbed before the node binds it.
func TestPortTakenIsAClearStartupError(t *testing.T) {
	c := newCluster(t, 3)
	httpTaken, raftTaken := c.nodes[1].httpAddr, c.nodes[2].raftAddr
	for _, addr := range []string{httpTaken, raftTaken} {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
	}
	c.bootstrap()
	if c.nodes[1].httpAddr == httpTaken || c.nodes[2].raftAddr == raftTaken {
		t.Fatal("the cluster runs on the ports that were taken")
	}
	for _, tc := range []struct {
		node int
		want string
	}{
		{1, "kvrouter: http listen on " + httpTaken + ": listen tcp " + httpTaken + ": bind: address already in use\n"},
		{2, "kvrouter: raft transport on " + raftTaken + ": listen tcp " + raftTaken + ": bind: address already in use\n"},
	} {
		b, err := os.ReadFile(c.nodes[tc.node].logPath)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), tc.want) {
			t.Errorf("%s's log does not say %q:\n%s", c.nodes[tc.node].id, tc.want, b)
		}
	}
	c.converged()
}
