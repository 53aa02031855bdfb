package e2e

import (
	"fmt"
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
	// Both nodes whose ports are taken exit, each naming its address. (The
	// harness's bootstrap kills the cluster as soon as one of them exits,
	// which can be before the other got to its listen.)
	for i := range c.nodes {
		c.start(i)
	}
	c.waitFor(readyTimeout, "the nodes with taken ports to exit", func() (bool, string) {
		return !c.nodes[1].up() && !c.nodes[2].up(), fmt.Sprintf("n2 up %v, n3 up %v", c.nodes[1].up(), c.nodes[2].up())
	})
	for _, tc := range []struct {
		node int
		want string
	}{
		{1, "kvrouter: http listen on " + httpTaken + ": listen tcp " + httpTaken + ": bind: address already in use\n"},
		{2, "kvrouter: raft transport on " + raftTaken + ": listen tcp " + raftTaken + ": bind: address already in use\n"},
	} {
		if out := c.runLog(tc.node); !strings.Contains(out, tc.want) {
			t.Errorf("%s's log does not say %q:\n%s", c.nodes[tc.node].id, tc.want, out)
		}
	}
	c.killAll()
	for _, n := range c.nodes {
		if err := os.RemoveAll(n.dir); err != nil {
			t.Fatal(err)
		}
	}
	// Started again on the same ports, the harness moves the cluster to
	// other ones.
	c.bootstrap()
	if c.nodes[1].httpAddr == httpTaken || c.nodes[2].raftAddr == raftTaken {
		t.Fatal("the cluster runs on the ports that were taken")
	}
	c.converged()
}
