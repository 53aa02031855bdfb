package raftfsm

import (
	"strings"
	"testing"
)

// FuzzParsePeers: --peers (kvrouter, kvctl's offline seed) never
// panics; what it takes has every address checked, and reads back the same
// when written again as id=raftaddr=httpaddr entries.
func FuzzParsePeers(f *testing.F) {
	for _, s := range []string{
		"a=127.0.0.1:7000=127.0.0.1:8000,b=[::1]:7001=[::1]:8001",
		"a=[::ffff:1.2.3.4]:7000=h:1,b=1.2.3.4:07000=h:2",
		"a=Node1.:1=n:2,b=node1:1=n:3", "a=h:0=h:1", "a=[fe80::1%eth0]:1=h:2", "", ",", "a==",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ms, err := ParsePeers(s)
		if err != nil {
			return
		}
		var parts []string
		for _, m := range ms {
			if CheckRaftAddr(m.RaftAddr) != nil || CheckHTTPAddr(m.HTTPAddr) != nil || !m.Voter {
				t.Fatalf("%q: took %+v", s, m)
			}
			parts = append(parts, m.ID+"="+m.RaftAddr+"="+m.HTTPAddr)
		}
		again, err := ParsePeers(strings.Join(parts, ","))
		if err != nil || len(again) != len(ms) {
			t.Fatalf("%q: %v re-read as %v, %v", s, ms, again, err)
		}
		for i := range ms {
			if again[i] != ms[i] {
				t.Fatalf("%q: %v re-read as %v", s, ms, again)
			}
		}
	})
}
