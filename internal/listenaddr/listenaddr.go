// Package listenaddr says whether two TCP listen addresses clash: whether
// a process (or two) listening on both would see the second listen fail
// with "address already in use". kvrouter and kvagent refuse such a pair
// of their flags as a usage error, before they create or listen on
// anything, where the second listen would otherwise fail half-way through
// the start.
package listenaddr

import (
	"net"
	"net/netip"
	"strings"
)

// Same reports whether listening on a and on b (host:port, as net.Listen
// takes them) would clash: the same port, other than 0 (each listener
// on port 0 gets a free port of its own), on hosts that are one, or one
// of which is a wildcard that covers the other (empty or ::, every
// address; 0.0.0.0, every IPv4 address, and a hostname, which may resolve
// to one). Ports are compared as numbers (07000 is 7000, a service name
// its number), IPs once parsed (an IPv4-mapped address is its IPv4 one);
// a hostname as text, without letter case or a final dot, not resolved:
// localhost and 127.0.0.1 are not taken for one, as the start would then
// depend on the resolver. An address that does not parse clashes with
// nothing: the flag's own check refuses it.
func Same(a, b string) bool {
	ha, hb, ok := SamePort(a, b)
	if !ok {
		return false
	}
	ia, okA := IP(ha)
	ib, okB := IP(hb)
	switch {
	case ha == "" || hb == "" || (okA && ia == netip.IPv6Unspecified()) || (okB && ib == netip.IPv6Unspecified()):
		return true // every address, IPv4 ones too (dual stack)
	case okA && ia.IsUnspecified():
		return !okB || ib.Is4() // 0.0.0.0: every IPv4 address
	case okB && ib.IsUnspecified():
		return !okA || ia.Is4()
	case okA && okB:
		return ia == ib
	case !okA && !okB:
		return strings.EqualFold(strings.TrimSuffix(ha, "."), strings.TrimSuffix(hb, "."))
	}
	return false
}

// SamePort reports whether a and b (host:port) name the same TCP port,
// other than 0, compared as numbers (07000 is 7000, a service name its
// number), and returns their hosts, unparsed. An address that does not
// split, or a port that does not parse, is no port's.
func SamePort(a, b string) (hostA, hostB string, ok bool) {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil {
		return "", "", false
	}
	na, errA := net.LookupPort("tcp", pa)
	nb, errB := net.LookupPort("tcp", pb)
	if errA != nil || errB != nil || na == 0 || na != nb {
		return "", "", false
	}
	return ha, hb, true
}

// IP parses host as an IP (an IPv4-mapped one as its IPv4 address); ok is
// false for a hostname.
func IP(host string) (ip netip.Addr, ok bool) {
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, false
	}
	return ip.Unmap(), true
}
