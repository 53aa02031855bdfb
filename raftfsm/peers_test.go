package raftfsm

import (
	"strconv"
	"strings"
	"testing"
)

// TestRaftAddrIsOneThatPeersCanDial: a Raft address is listed in the
// cluster's configuration and dialed by the peers as written, so it needs
// a host they can dial (not none, not a wildcard) and a port; kvrouter's
// --raft-addr and a --peers entry's (kvrouter, kvctl's offline seed) are
// checked by the same rule. From a review: the seed took --peers entries
// at 0.0.0.0:7946 or :7946, which kvrouter refuses as --raft-addr, and
// left a directory that no node could start on. A wildcard with a zone
// (an IPv6 address may carry one) is a wildcard too: a second review found
// [::%lo]:7946 taken, which a dial sends to this host's loopback as it
// does [::]:7946.
func TestRaftAddrIsOneThatPeersCanDial(t *testing.T) {
	for _, ok := range []string{"10.0.0.1:7946", "[::1]:7946", "[fe80::1%eth0]:7946", "node1.example:7946", "127.0.0.1:0"} {
		if err := CheckRaftAddr(ok); err != nil {
			t.Errorf("CheckRaftAddr(%q): %v", ok, err)
		}
	}
	for _, c := range []struct{ addr, want string }{
		{"10.0.0.1", "want host:port"},
		{"10.0.0.1:99999", `port "99999": want a number from 0 to 65535`},
		{"10.0.0.1:x", `port "x"`},
		{":7946", "has no host"},
		{"0.0.0.0:7946", "0.0.0.0 listens on every interface"},
		{"[::]:7946", ":: listens on every interface"},
		{"[::%lo]:7946", "::%lo listens on every interface"},
		{"[::%1]:7946", "::%1 listens on every interface"},
		{"[::ffff:0.0.0.0]:7946", "::ffff:0.0.0.0 listens on every interface"},
		{"[::ffff:0.0.0.0%lo]:7946", "::ffff:0.0.0.0%lo listens on every interface"},
	} {
		if err := CheckRaftAddr(c.addr); err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), `"`+c.addr+`"`) {
			t.Errorf("CheckRaftAddr(%q): %v, want an error that begins with the address and says %q", c.addr, err, c.want)
		}
	}
}

// TestParsePeersChecksRaftAddrs: a peer list's Raft addresses are checked
// as kvrouter --raft-addr is (CheckRaftAddr), and port 0 is refused too:
// the peers dial the port as listed, where a node told to listen on port 0
// takes any free one.
func TestParsePeersChecksRaftAddrs(t *testing.T) {
	const good = "n1=10.0.0.1:7946=10.0.0.1:7080,n2=n2.example:7946=n2.example:7080"
	if ps, err := ParsePeers(good); err != nil || len(ps) != 2 {
		t.Fatalf("ParsePeers(%q) = %v, %v", good, ps, err)
	}
	for _, c := range []struct{ peers, want string }{
		{"n1=0.0.0.0:7946=10.0.0.1:7080", `raft address "0.0.0.0:7946": 0.0.0.0 listens on every interface`},
		{"n1=10.0.0.1:7946=10.0.0.1:7080,n2=:7946=10.0.0.2:7080", `raft address ":7946" has no host`},
		{"n1=10.0.0.1:99999=10.0.0.1:7080", `raft address "10.0.0.1:99999": port "99999"`},
		{"n1=10.0.0.1:0=10.0.0.1:7080", `raft address "10.0.0.1:0": port 0`},
		{"n1=10.0.0.1=10.0.0.1:7080", `raft address "10.0.0.1"`},
		{"n1=10.0.0.1:7946=10.0.0.1", `http address "10.0.0.1": address 10.0.0.1: missing port in address: want host:port`},
		// The member table lists the HTTP address, and followers forward
		// to it: a wildcard reaches the forwarding node itself.
		{"n1=10.0.0.1:7946=0.0.0.0:7080", `http address "0.0.0.0:7080": 0.0.0.0 listens on every interface`},
		{"n1=10.0.0.1:7946=[::]:7080", `http address "[::]:7080": :: listens on every interface`},
		{"n1=10.0.0.1:7946=:7080", `http address ":7080" has no host`},
		{"n1=10.0.0.1:7946=10.0.0.1:0", `http address "10.0.0.1:0": port 0`},
		// An id the members API refuses (limits.ID): it could not be
		// removed or made leader through it.
		{strings.Repeat("n", 300) + "=10.0.0.1:7946=10.0.0.1:7080", `id is 300 bytes long (at most 256)`},
		{"n1\x7f=10.0.0.1:7946=10.0.0.1:7080", `holds a control character`},
	} {
		if _, err := ParsePeers(c.peers); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParsePeers(%q): %v, want an error with %q", c.peers, err, c.want)
		}
	}
}

// TestHTTPAddrIsOneTheOthersCanDial: a member's HTTP address is where the
// other nodes forward writes to while it leads, so it needs a host they
// can dial and a port other than 0 (kvrouter --http-advertise, --peers
// entries, POST /v1/cluster/members). From a review: 0.0.0.0:7080 was
// taken into the member table, and a follower forwarded to itself.
func TestHTTPAddrIsOneTheOthersCanDial(t *testing.T) {
	for _, ok := range []string{"10.0.0.1:7080", "[::1]:7080", "node1.example:7080"} {
		if err := CheckHTTPAddr(ok); err != nil {
			t.Errorf("CheckHTTPAddr(%q): %v", ok, err)
		}
	}
	for _, c := range []struct{ addr, want string }{
		{"10.0.0.1", "want host:port"},
		{":7080", "has no host"},
		{"0.0.0.0:7080", "0.0.0.0 listens on every interface"},
		{"[::]:7080", ":: listens on every interface"},
		{"[::%lo]:7080", "::%lo listens on every interface"},
		{"10.0.0.1:0", "port 0"},
		{"10.0.0.1:00", "port 0"},
		{"node1.example:http", "want a number"},
	} {
		if err := CheckHTTPAddr(c.addr); err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), `"`+c.addr+`"`) {
			t.Errorf("CheckHTTPAddr(%q): %v, want an error that begins with the address and says %q", c.addr, err, c.want)
		}
	}
}

// TestAddrPortsAreNumbers: a member's Raft and HTTP addresses take a port
// number, not a service name (10.0.0.4:http), as POST /v1/cluster/members
// does (api checkAddr): the other members and the API read the address as
// written. From a review: CheckHTTPAddr took 10.0.0.4:http, so a --join
// asking to be added there passed kvrouter's checks and was refused by
// the cluster.
func TestAddrPortsAreNumbers(t *testing.T) {
	for _, addr := range []string{"10.0.0.4:http", "10.0.0.4:https", "h:x11", "h:+80", "h:0x50"} {
		if err := CheckHTTPAddr(addr); err == nil {
			t.Errorf("CheckHTTPAddr(%q) accepted a port that is not a number", addr)
		}
		if err := CheckRaftAddr(addr); err == nil {
			t.Errorf("CheckRaftAddr(%q) accepted a port that is not a number", addr)
		}
	}
	for _, addr := range []string{"10.0.0.4:80", "[fe80::1%eth0]:7080", "h:65535"} {
		if err := CheckHTTPAddr(addr); err != nil {
			t.Errorf("CheckHTTPAddr(%q): %v", addr, err)
		}
		if err := CheckRaftAddr(addr); err != nil {
			t.Errorf("CheckRaftAddr(%q): %v", addr, err)
		}
	}
}

// TestParsePeersReadsPortsAsNumbers: a --peers entry's Raft port 0 is
// refused however it is written, and one address written twice is a
// duplicate however its port or IP is spelled. From a review: the port was
// compared as text ("00" passed as not "0"), and so were the addresses
// (127.0.0.1:7000 and 127.0.0.1:07000, one address, were two peers).
func TestParsePeersReadsPortsAsNumbers(t *testing.T) {
	for _, p := range []string{"0", "00", "000", "0000"} {
		peers := "n1=127.0.0.1:" + p + "=127.0.0.1:7080,n2=127.0.0.1:7001=127.0.0.1:7081"
		if ms, err := ParsePeers(peers); err == nil || !strings.Contains(err.Error(), "port 0") {
			t.Errorf("ParsePeers(%q) = %+v, %v: want raft port %q refused as port 0", peers, ms, err, p)
		}
	}
	for _, c := range []struct{ peers, want string }{
		{"n1=127.0.0.1:7000=127.0.0.1:7080,n2=127.0.0.1:07000=127.0.0.1:7081", "raft address 127.0.0.1:07000 given twice"},
		{"n1=127.0.0.1:7000=127.0.0.1:7080,n2=127.0.0.1:7001=127.0.0.1:07080", "http address 127.0.0.1:07080 given twice"},
		{"n1=h1:7000=h1:7080,n2=h1:0007000=h2:7080", "raft address h1:0007000 given twice"},
		{"n1=[::ffff:10.0.0.1]:7000=h1:7080,n2=10.0.0.1:7000=h2:7080", "raft address 10.0.0.1:7000 given twice"},
		{"n1=[0:0::1]:7000=h1:7080,n2=[::1]:7000=h2:7080", "raft address [::1]:7000 given twice"},
		{"a=Node1:7000=n1:7080,b=node1:7000=n2:7080", "raft address node1:7000 given twice"},
		{"a=node1.:7000=n1:7080,b=node1:7000=n2:7080", "raft address node1:7000 given twice"},
	} {
		if ms, err := ParsePeers(c.peers); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParsePeers(%q) = %+v, %v: want an error with %q", c.peers, ms, err, c.want)
		}
	}
	// Other zones, hosts or ports are other addresses.
	for _, ok := range []string{
		"n1=[fe80::1%eth0]:7000=h1:7080,n2=[fe80::1%eth1]:7000=h2:7080",
		"n1=h1:7000=h1:7080,n2=h1:7001=h1:7081",
	} {
		if _, err := ParsePeers(ok); err != nil {
			t.Errorf("ParsePeers(%q): %v", ok, err)
		}
	}
}

// TestAddrHostIsANameOrAnIP: a member's Raft and HTTP addresses are a host
// name, an IPv4 address or a bracketed IPv6 address (a zone of URL-safe
// characters), and a port; nothing else. From a review: the members API
// took an HTTP address with a '/', '@', ' ', '?' or '#' in its host,
// which the forwarding code refuses, so every write sent to a follower
// was 503 no_leader once that member led.
func TestAddrHostIsANameOrAnIP(t *testing.T) {
	for _, ok := range []string{
		"n4.example:7080", "N4.Example.:7080", "n4-a_b.example:7080", "localhost:7080", "10.0.0.4:7080",
		"[::1]:7080", "[::ffff:10.0.0.4]:7080", "[fe80::1%eth0.100]:7080", "[fe80::1%3]:7080",
	} {
		if err := CheckHTTPAddr(ok); err != nil {
			t.Errorf("CheckHTTPAddr(%q): %v", ok, err)
		}
		if err := CheckRaftAddr(ok); err != nil {
			t.Errorf("CheckRaftAddr(%q): %v", ok, err)
		}
	}
	for _, c := range []struct{ addr, want string }{
		{"n4.example/x:7080", `host "n4.example/x"`},
		{"user@n4.example:7080", `host "user@n4.example"`},
		{"n4 example:7080", `host "n4 example"`},
		{"n4.example?x:7080", `host "n4.example?x"`},
		{"n4.example#x:7080", `host "n4.example#x"`},
		{"n4..example:7080", `host "n4..example"`},
		{"-n4.example:7080", `host "-n4.example"`},
		{"n4-.example:7080", `host "n4-.example"`},
		{"nä.example:7080", `host "nä.example"`},
		{strings.Repeat("a", 64) + ".example:7080", "host"},
		{"999.0.0.1:7080", `host "999.0.0.1"`},
		{"10.0.0:7080", `host "10.0.0"`},
		{"[n4.example]:7080", `host "n4.example" in brackets`},
		{"[10.0.0.4]:7080", `host "10.0.0.4" in brackets`},
		{"[fe80::1%eth 0]:7080", `zone "eth 0"`},
		{"[fe80::1%eth0/x]:7080", `zone "eth0/x"`},
	} {
		for name, check := range map[string]func(string) error{"CheckHTTPAddr": CheckHTTPAddr, "CheckRaftAddr": CheckRaftAddr} {
			if err := check(c.addr); err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), strconv.Quote(c.addr)) {
				t.Errorf("%s(%q): %v, want an error that begins with the address and says %q", name, c.addr, err, c.want)
			}
		}
	}
	if _, err := ParsePeers("n1=10.0.0.1:7946=n1 x:7080"); err == nil || !strings.Contains(err.Error(), `http address "n1 x:7080": host "n1 x"`) {
		t.Errorf("ParsePeers with an http address of host \"n1 x\": %v", err)
	}
}
