package raftfsm

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// aliasLookupTimeout bounds the name lookups of an add's alias check
// (raftAddrAlias), all of them together: a resolver that does not answer
// by then proves no alias, and the add goes on.
const aliasLookupTimeout = 2 * time.Second

// checkMemberRaftAddr refuses a raft address that no peer can dial as a
// member's: a wildcard host (0.0.0.0:7000 reaches whatever listens on port
// 7000 of the dialling node's host: the leader itself, when it is the
// one) or port 0, as kvrouter refuses them for its --raft-addr. An
// address that is not host:port (an in-memory transport's, in tests) is
// left to the transport.
func checkMemberRaftAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil
	}
	if err := CheckRaftAddr(addr); err != nil {
		return fmt.Errorf("%w: raft address %w", ErrInvalid, err)
	}
	if p, err := net.LookupPort("tcp", port); err == nil && p == 0 {
		return fmt.Errorf("%w: raft address %q: port 0 is a port the kernel picks, and peers cannot dial it", ErrInvalid, addr)
	}
	return nil
}

// checkMemberHTTPAddr refuses an HTTP address that followers could not
// forward writes to while the member leads (CheckHTTPAddr: a host that is
// no name or IP, a wildcard host, port 0), as the members API refuses it.
// An address that is not host:port (an in-memory transport's name, in
// tests) is taken, as checkMemberRaftAddr takes one.
func checkMemberHTTPAddr(addr string) error {
	if err := undialableHTTPAddr(addr); err != nil {
		return fmt.Errorf("%w: http address %w", ErrInvalid, err)
	}
	return nil
}

// raftAddrAlias returns the server of servers, other than id, whose raft
// address addr reaches under another spelling: both resolve to one
// IP:port (localhost:7001 and 127.0.0.1:7001, a name and its IP). The
// unspecified address counts as the loopback ones a dial of it reaches
// (Linux; lookupRaftAddr), though CheckRaftAddr refuses it in an added
// address: a member listed at one by an older build. Other IPs of one host are other listeners: a kvrouter listens
// on its --raft-addr's IP alone (NewNode binds it), so 127.0.0.2:7001 or
// the host's LAN IP do not reach a member at 127.0.0.1:7001, and nodes on
// one host at 127.0.0.1, 127.0.0.2, ... with one port are a cluster.
//
// An address whose host does not resolve now (a node not yet running, its
// name not yet published) proves no alias, and neither does a member's:
// only a proven alias is refused, and an unresolved one, added, stays a
// non-voter until a node answers there as itself (commitWatch.answeredBy).
// The lookups share aliasLookupTimeout, within ctx.
func raftAddrAlias(ctx context.Context, servers []raft.Server, id, addr string) (raft.Server, bool) {
	addrs := make([]string, len(servers))
	for i, s := range servers {
		if string(s.ID) != id {
			addrs[i] = string(s.Address)
		}
	}
	if i, ok := addrAlias(ctx, addr, addrs); ok {
		return servers[i], true
	}
	return raft.Server{}, false
}

// httpAddrAlias returns the id of the member of members, other than id,
// whose HTTP address addr reaches under another spelling, as
// raftAddrAlias does for raft addresses (localhost:7081 and
// 127.0.0.1:7081): followers would forward writes meant for id's node,
// once it leads, to that member. Members are tried in the order of their
// ids.
func httpAddrAlias(ctx context.Context, members map[string]Member, id, addr string) (string, bool) {
	ids := make([]string, 0, len(members))
	for mid := range members {
		if mid != id {
			ids = append(ids, mid)
		}
	}
	slices.Sort(ids)
	addrs := make([]string, len(ids))
	for i, mid := range ids {
		addrs[i] = members[mid].HTTPAddr
	}
	if i, ok := addrAlias(ctx, addr, addrs); ok {
		return ids[i], true
	}
	return "", false
}

// addrAlias returns the index of the first of addrs that addr reaches
// under another spelling: both resolve to one IP:port (lookupRaftAddr).
// An empty address in addrs is none. The lookups share
// aliasLookupTimeout, within ctx.
func addrAlias(ctx context.Context, addr string, addrs []string) (int, bool) {
	ctx, cancel := context.WithTimeout(ctx, aliasLookupTimeout)
	defer cancel()
	mine := lookupRaftAddr(ctx, addr)
	if len(mine) == 0 {
		return 0, false
	}
	theirs := make([][]netip.AddrPort, len(addrs))
	var wg sync.WaitGroup
	for i, a := range addrs {
		if a == "" {
			continue
		}
		wg.Go(func() { theirs[i] = lookupRaftAddr(ctx, a) })
	}
	wg.Wait()
	for i := range addrs {
		for _, a := range mine {
			if slices.Contains(theirs[i], a) {
				return i, true
			}
		}
	}
	return 0, false
}

// lookupRaftAddr returns the IP:ports a dial of addr may reach (IPs
// unmapped; zones kept on link-local IPs alone, where a zone picks the
// link: fe80::1%eth0 and fe80::1%eth1 are two hosts, while Linux ignores
// the zone of any other IP), nil when addr is not host:port or its host
// does not resolve. An IP literal needs no lookup, and localhost none
// either (the loopback addresses, whatever the hosts file says); an
// unspecified IP is the loopback one that a dial of it reaches
// (raftAddrAlias): 0.0.0.0 is 127.0.0.1, and :: both ::1 and 127.0.0.1,
// as Go's dialer tries 0.0.0.0 after :: (for a host whose IPv6 binds ::
// but cannot connect to it: golang.org/issue/18806).
func lookupRaftAddr(ctx context.Context, addr string) []netip.AddrPort {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil
	}
	p, err := net.DefaultResolver.LookupPort(ctx, "tcp", port)
	if err != nil || p <= 0 || p > 65535 {
		return nil
	}
	var ips []netip.Addr
	switch ip, err := netip.ParseAddr(host); {
	case err == nil:
		ips = []netip.Addr{ip}
	case strings.EqualFold(host, "localhost"):
		ips = []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()}
	default:
		found, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil
		}
		ips = found
	}
	loopback4 := netip.AddrFrom4([4]byte{127, 0, 0, 1})
	out := make([]netip.AddrPort, 0, len(ips)+1)
	for _, ip := range ips {
		ip = ip.Unmap()
		if !ip.IsLinkLocalUnicast() {
			ip = ip.WithZone("")
		}
		switch {
		case ip == netip.IPv4Unspecified():
			out = append(out, netip.AddrPortFrom(loopback4, uint16(p)))
		case ip == netip.IPv6Unspecified():
			out = append(out, netip.AddrPortFrom(netip.IPv6Loopback(), uint16(p)), netip.AddrPortFrom(loopback4, uint16(p)))
		default:
			out = append(out, netip.AddrPortFrom(ip, uint16(p)))
		}
	}
	return out
}
