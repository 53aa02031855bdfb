package raftfsm

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/internal/limits"
)

// ParsePeers parses a bootstrap peer list, id=raftaddr=httpaddr,...
// (kvrouter --peers, kvctl snapshot restore --peers): each entry three
// non-empty fields, an id the members API takes (limits.ID), both
// addresses host:port, and no id, Raft address or
// HTTP address given twice (an address as dialled, addrKey: 10.0.0.1:07000
// is 10.0.0.1:7000). A Raft address must be one that peers can
// dial (CheckRaftAddr, as kvrouter checks its --raft-addr), with a port
// other than 0 (the number: 00 is 0 too): the peers dial it as listed, while a node told to listen
// on port 0 takes any free one. (A lone node may run at --raft-addr
// host:0: nobody dials it.) A seed of kvctl's with such an address left a
// directory that no node could start on. An HTTP address is checked by
// CheckHTTPAddr: the member table lists it. Empty entries are skipped; the
// members are voters. An empty list parses to none.
func ParsePeers(s string) ([]Member, error) {
	var out []Member
	seen := map[string]string{} // what and addrKey → the text first given
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		f := strings.Split(p, "=")
		if len(f) != 3 || f[0] == "" || f[1] == "" || f[2] == "" {
			return nil, fmt.Errorf("peer %q: want id=raftaddr=httpaddr", p)
		}
		// The members API's rule: an id it refuses could not be removed
		// or made leader through it.
		if why := limits.ID(f[0]); why != "" {
			return nil, fmt.Errorf("peer %q: id %s", p, why)
		}
		if err := CheckRaftAddr(f[1]); err != nil {
			return nil, fmt.Errorf("peer %q: raft address %w", p, err)
		}
		// The number, not the text: 00 is port 0 too (CheckRaftAddr
		// parsed it, so it is one).
		if _, port, _ := net.SplitHostPort(f[1]); mustPort(port) == 0 {
			return nil, fmt.Errorf("peer %q: raft address %q: port 0: want the port the node listens on, as its peers dial it (1 to 65535)", p, f[1])
		}
		if err := CheckHTTPAddr(f[2]); err != nil {
			return nil, fmt.Errorf("peer %q: http address %w", p, err)
		}
		// Addresses are keyed as dialled, not as written: 127.0.0.1:07000
		// is 127.0.0.1:7000, and two peers there would be one process.
		for _, k := range []struct{ what, text, key string }{
			{"id", f[0], f[0]},
			{"raft address", f[1], addrKey(f[1])},
			{"http address", f[2], addrKey(f[2])},
		} {
			key := k.what + " " + k.key
			if first, dup := seen[key]; dup {
				if first != k.text {
					return nil, fmt.Errorf("peer %q: %s %s given twice (as %s before)", p, k.what, k.text, first)
				}
				return nil, fmt.Errorf("peer %q: %s %s given twice", p, k.what, k.text)
			}
			seen[key] = k.text
		}
		out = append(out, Member{ID: f[0], RaftAddr: f[1], HTTPAddr: f[2], Voter: true})
	}
	return out, nil
}

// mustPort reads a port that CheckRaftAddr or CheckHTTPAddr took: a
// number from 0 to 65535.
func mustPort(port string) uint64 {
	p, _ := strconv.ParseUint(port, 10, 16)
	return p
}

// addrKey is a host:port that CheckRaftAddr or CheckHTTPAddr took, as it
// is dialled: the port as a number (07000 is 7000), an IP host in netip's
// form ([0:0::1] is [::1], an IPv4-mapped address its IPv4 one, as
// SameRaftAddr reads them; a zone kept: another zone is another link). A
// hostname is taken as DNS takes it, without letter case or a final dot
// (Node1. is node1), but not resolved: resolving it would make the check
// depend on the resolver.
func addrKey(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		host = ip.Unmap().String()
	} else {
		host = strings.ToLower(strings.TrimSuffix(host, "."))
	}
	return net.JoinHostPort(host, strconv.FormatUint(mustPort(port), 10))
}

// CheckRaftAddr says what is wrong with addr as a node's Raft address,
// nil when nothing is: host:port, the port a number from 0 to 65535 (not
// a service name, which the members API refuses), and a host that peers can
// dial (a name or an IP, checkHost; not a wildcard such as 0.0.0.0 or ::,
// with a zone or IPv4-mapped or not), since it is the
// address the cluster's configuration lists the node at. kvrouter checks
// its --raft-addr with it, and ParsePeers every --peers entry's, so that
// kvctl's offline seed refuses what kvrouter would refuse. The error
// begins with addr, quoted, for the caller to put the flag or entry in
// front.
func CheckRaftAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q: %v: want host:port", addr, err)
	}
	// A number, not a service name (:http): the other members, and the
	// members API that adds one (api checkAddr), read the port as written.
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("%q: port %q: want a number from 0 to 65535", addr, port)
	}
	if host == "" {
		return fmt.Errorf("%q has no host: give this node's own address, as its peers dial it (host:port)", addr)
	}
	if err := checkHost(addr, host); err != nil {
		return fmt.Errorf("%q: %w", addr, err)
	}
	// netip, not net.ParseIP: an IPv6 address may carry a zone, which
	// net.ParseIP does not parse (nil), and [::%lo]:7946 is dialled as
	// [::]:7946 is, to this host's loopback.
	if ip, err := netip.ParseAddr(host); err == nil && ip.WithZone("").Unmap().IsUnspecified() {
		return fmt.Errorf("%q: %s listens on every interface, and peers cannot dial it: give this node's own address, as its peers dial it (host:port)", addr, host)
	}
	return nil
}

// CheckHTTPAddr says what is wrong with addr as a member's HTTP address,
// nil when nothing is: the member table lists it, and followers forward
// writes to the leader there, so it needs a host the other nodes can dial
// (CheckRaftAddr's rules: a name or an IP, checkHost; not a wildcard such
// as 0.0.0.0, which reaches whatever listens on that port of the dialling
// node's host, the follower itself when it listens there) and a port
// other than 0, which the kernel picks anew at each listen. kvrouter
// checks its --http-advertise with it, ParsePeers every --peers entry's,
// the API an added member's, and a follower the leader's before it
// forwards a write there (api leaderURL): one rule, so that an address
// the member table takes is one a follower forwards to. The error begins
// with addr, quoted.
func CheckHTTPAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q: %v: want host:port", addr, err)
	}
	if host == "" {
		return fmt.Errorf("%q has no host: give the address the other nodes reach this node's HTTP API at (host:port)", addr)
	}
	if err := checkHost(addr, host); err != nil {
		return fmt.Errorf("%q: %w", addr, err)
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.WithZone("").Unmap().IsUnspecified() {
		return fmt.Errorf("%q: %s listens on every interface, and the other nodes cannot dial it: give the address they reach this node's HTTP API at (host:port)", addr, host)
	}
	p, err := strconv.ParseUint(port, 10, 16) // a number, as CheckRaftAddr's
	if err != nil {
		return fmt.Errorf("%q: port %q: want a number from 1 to 65535", addr, port)
	}
	if p == 0 {
		return fmt.Errorf("%q: port 0 is a port the kernel picks, and the other nodes cannot dial it: give the port they reach this node's HTTP API at (1 to 65535)", addr)
	}
	return nil
}

// checkHost says what is wrong with host, the host of addr (host:port) as
// net.SplitHostPort gives it, nil when nothing is: a host name (dot-separated
// labels of letters, digits, '-' and '_', as Go's resolver takes a name,
// a final dot allowed), an IPv4 address, or an IPv6 address in brackets,
// with a zone of letters, digits and "-._~" (an interface's name or
// index; RFC 6874). Anything else (a '/', '@', '?', '#' or a space; a
// name in brackets) is no host a peer can dial as written, nor one that a
// URL reads back as the same host: a follower would refuse to forward to
// it (api leaderURL).
func checkHost(addr, host string) error {
	if strings.HasPrefix(addr, "[") {
		ip, err := netip.ParseAddr(host)
		if err != nil || !ip.Is6() {
			return fmt.Errorf("host %q in brackets: want an IPv6 address there (a name or an IPv4 address goes without them)", host)
		}
		if z := ip.Zone(); strings.IndexFunc(z, func(r rune) bool { return !unreserved(r) }) >= 0 {
			return fmt.Errorf("zone %q: want an interface's name or index (letters, digits and -._~)", z)
		}
		return nil
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.Is4() {
		return nil
	}
	if !hostName(host) {
		return fmt.Errorf("host %q: want a host name (dot-separated labels of letters, digits, '-' and '_'), an IPv4 address or an IPv6 address in brackets", host)
	}
	return nil
}

// unreserved reports whether r is one of RFC 3986's unreserved characters.
func unreserved(r rune) bool {
	return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' ||
		r == '-' || r == '.' || r == '_' || r == '~'
}

// hostName reports whether s is a host name as Go's resolver takes one
// (net's isDomainName): labels of 1 to 63 letters, digits, '-' and '_',
// none starting or ending with '-', at most 254 bytes with a final dot,
// and not all digits (999.0.0.1 is no IPv4 address, and no name either).
func hostName(s string) bool {
	if len(s) == 0 || len(s) > 254 || (len(s) == 254 && s[253] != '.') {
		return false
	}
	last := byte('.')
	nonNumeric := false
	label := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || c == '_':
			nonNumeric = true
			label++
		case '0' <= c && c <= '9':
			label++
		case c == '-':
			if last == '.' { // a label starts with no '-'
				return false
			}
			nonNumeric = true
			label++
		case c == '.':
			if last == '.' || last == '-' { // no empty label, none ends with '-'
				return false
			}
			if label > 63 {
				return false
			}
			label = 0
		default:
			return false
		}
		last = c
	}
	return last != '-' && label <= 63 && nonNumeric
}
