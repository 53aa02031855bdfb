package raftfsm

import (
	"fmt"
	"net"
	"strings"
)

// ParsePeers parses a bootstrap peer list, id=raftaddr=httpaddr,...
// (kvrouter --peers, kvctl snapshot restore --peers): each entry three
// non-empty fields, both addresses host:port, and no id, Raft address or
// HTTP address given twice. Empty entries are skipped; the members are
// voters. An empty list parses to none.
func ParsePeers(s string) ([]Member, error) {
	var out []Member
	seen := map[string]bool{}
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		f := strings.Split(p, "=")
		if len(f) != 3 || f[0] == "" || f[1] == "" || f[2] == "" {
			return nil, fmt.Errorf("peer %q: want id=raftaddr=httpaddr", p)
		}
		for _, a := range f[1:] {
			if _, _, err := net.SplitHostPort(a); err != nil {
				return nil, fmt.Errorf("peer %q: address %q: want host:port", p, a)
			}
		}
		for _, k := range []string{"id " + f[0], "raft address " + f[1], "http address " + f[2]} {
			if seen[k] {
				return nil, fmt.Errorf("peer %q: %s given twice", p, k)
			}
			seen[k] = true
		}
		out = append(out, Member{ID: f[0], RaftAddr: f[1], HTTPAddr: f[2], Voter: true})
	}
	return out, nil
}
