package raftfsm

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
)

// A cluster's identity, and the greeting that carries it.
//
// Nothing in hashicorp/raft's RPCs names a cluster: a server takes the
// entries of any leader with a term at least its own. So a node started
// at an address another cluster still lists (a port reused, a peer
// misconfigured) was taken over by that cluster's leader: its log
// truncated and refilled with the other cluster's entries, its state
// replaced, and its own cluster one voter short. It only logged that its
// configuration differed from the leader's. A CI run saw it: a test
// node got the port of another package's stopped node, whose cluster's
// leader replicated its 3,806 entries into it.
//
// So every connection a stream layer dials opens with a greeting
// (greetingMagic, a version, the dialer's cluster id, whether that id is
// settled, its node id and raft address), and every connection it
// accepts is answered before raft reads a byte of it: taken, or refused
// with the acceptor's own id. A connection from another cluster is
// refused, and raft's RPC on it fails (ErrForeignCluster) before either
// side acts on it. As etcd does with its cluster id in every message.
//
// Where the id comes from (Node.greetAsRecorded, and the records startRaft
// makes at a directory's first start):
//
//   - A directory bootstrapped from --peers derives it from that
//     configuration (deriveClusterID): every node of a new cluster is
//     given the same --peers (docs/operations.md), so all derive the
//     same id without talking. Two clusters differ in an id or an
//     address, so in their ids. With --cluster-name (Config.ClusterName)
//     it is derived from the name instead (namedClusterID): for nodes
//     whose --peers differ because they reach each other at other
//     addresses (a proxy per link, as the e2e partition tests run).
//   - A directory seeded from a snapshot (kvctl snapshot restore
//     --data-dir) derives it from the seed's configuration, the same way.
//   - A directory started empty to join (--join, kvctl members add)
//     takes the id of the first settled cluster that greets it: only a
//     cluster that lists its address greets it, and it asked to join
//     one.
//   - A directory of a build before greetings has none, and is neither
//     checked nor checks (a zero id): upgrading a cluster keeps it
//     working as it did. Only clusters bootstrapped or seeded by this
//     build, or later, are told apart.
//
// A derived id is provisional until a connection confirms it (a greeting
// of it taken, an answer naming it; kept across restarts:
// clusterIDProvisionalKey), or the node, caught up, is its cluster's only
// member: a directory bootstrapped from --peers may be a wiped member's,
// started again with --peers that are not the cluster's first (a member
// replaced since), so it derived another id. A provisional node takes
// the id of a settled greeter that its --peers list at that id and
// address, takes the connections of an unsettled one they list without
// its id (two members of a cluster of no id, an older build's, wiped and
// started with different --peers, derive different ids that no
// connection confirms), and refuses one they do not list: the other
// cluster's leader, at other addresses. It keeps its id while it waits:
// a member wiped while a node of an older build led caught up with no
// connection confirming its id, and dropping it then left it greeting
// no one for good (a review with the binaries). A joiner's id is settled
// once taken, and so is none once the node caught up with a cluster
// that greets with none.
//
// Connections of builds before greetings are taken unchecked, both ways,
// so that a rolling upgrade and its rollback keep working: a node of
// such a build reads the greeting's first byte as an unknown RPC type
// and closes the connection without an answer, and the dialer dials
// again without a greeting (Dial); an accepted connection whose first
// byte is not greetingMagic's is an RPC of such a build (streamConn.Read).

// ClusterID names a cluster (greeting.go). The zero value is none.
type ClusterID [16]byte

// String returns the id in hex, "none" for the zero value.
func (c ClusterID) String() string {
	if c.IsZero() {
		return "none"
	}
	return hex.EncodeToString(c[:])
}

// IsZero reports whether c is no id.
func (c ClusterID) IsZero() bool { return c == ClusterID{} }

// deriveClusterID returns the id of a cluster whose first configuration
// is servers: the first 16 bytes of the SHA-256 of its servers sorted by
// id, each with its address and suffrage, so the order of --peers does
// not matter. It is never zero (but with odds of 2^-128).
func deriveClusterID(servers []raft.Server) ClusterID {
	s := slices.Clone(servers)
	slices.SortFunc(s, func(a, b raft.Server) int { return strings.Compare(string(a.ID), string(b.ID)) })
	h := sha256.New()
	h.Write([]byte("kvrouter cluster v1\n"))
	for _, sv := range s {
		fmt.Fprintf(h, "%s\x00%s\x00%s\n", sv.ID, sv.Address, sv.Suffrage)
	}
	var id ClusterID
	copy(id[:], h.Sum(nil))
	return id
}

// namedClusterID returns the id of a cluster named name (Config.ClusterName):
// the first 16 bytes of the SHA-256 of the name, apart from any derived
// from servers.
func namedClusterID(name string) ClusterID {
	h := sha256.New()
	h.Write([]byte("kvrouter cluster name v1\n"))
	h.Write([]byte(name))
	var id ClusterID
	copy(id[:], h.Sum(nil))
	return id
}

// identity is what a stream layer greets with and checks greetings
// against. A stream layer's identity is replaced whole (setIdentity).
type identity struct {
	id   ClusterID // zero: none (a directory of a build before greetings)
	self string    // this node's id
	addr string    // this node's raft address, as configured
	// provisional: no connection has confirmed the derived id yet (nor
	// the node, caught up, found itself its cluster's only member), or
	// the node is a joiner not yet caught up. It may take a settled
	// greeter's id (a joiner of none yet: any; otherwise one its --peers
	// list), takes the connections of unsettled greeters its --peers
	// list, and greets as unsettled (verdict).
	provisional bool
	joiner      bool
	listed      func(id, addr string) bool // whether --peers list a server at that id and address; nil: none
	adopted     func(ClusterID)            // records an id taken from a greeter; nil: none
	confirmed   func()                     // records that a connection confirmed the provisional id; nil: none
}

// The greeting's layout. A dialer sends
//
//	greetingMagic (4) | greetingVersion (1) | flags (1) | cluster id (16) |
//	len (2) | node id | len (2) | raft address
//
// and the acceptor answers with a verdict (greetTaken, greetRefused,
// greetUnreadable: with the version it reads in the next byte) and its
// own cluster id (16), or, over its cap of connections, with greetBusy
// alone. greetingMagic's first byte is none of hashicorp/raft's RPC types
// (0 to 5), which a build before greetings sends first. Every close a
// node of this build makes of a greeted connection is answered, so a
// dialer takes only an unanswered close for an older build's.
var greetingMagic = [4]byte{0xc7, 'k', 'v', 'r'}

const (
	greetingVersion = 1
	greetSettled    = 1 << 0 // flags: the dialer's id is settled
	greetingFixed   = 4 + 1 + 1 + 16
	greetingMaxName = 1024 // the most bytes of a node id or an address
	greetTaken      = 1
	greetRefused    = 2
	greetUnreadable = 3
	greetBusy       = 4
	replyLen        = 1 + 16
)

// Errors of the greeting within the package (ErrForeignCluster is
// exported).
var (
	// errUngreeted means the acceptor closed the connection without
	// answering the greeting: a build before greetings (Dial dials it
	// again without one).
	errUngreeted = errors.New("raft transport: the peer closed the connection without answering the greeting")
	// errBadGreeting means a greeting could not be read.
	errBadGreeting = errors.New("raft transport: malformed greeting")
	// errBusy means the acceptor held as many connections as it takes.
	errBusy = errors.New("raft transport: the peer holds as many inbound connections as it takes")
)

// appendGreeting appends id's greeting to b.
func appendGreeting(b []byte, id *identity) []byte {
	b = append(b, greetingMagic[:]...)
	b = append(b, greetingVersion, 0)
	if !id.provisional {
		b[len(b)-1] |= greetSettled
	}
	b = append(b, id.id[:]...)
	for _, s := range []string{id.self, id.addr} {
		s = s[:min(len(s), greetingMaxName)]
		b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
		b = append(b, s...)
	}
	return b
}

// greeting is a greeting read by an acceptor.
type greeting struct {
	id      ClusterID
	settled bool
	self    string
	addr    string
}

// readGreeting reads a greeting whose first len(head) bytes are head,
// and the rest from r. It returns the greeting and what head held past
// it (a real dialer sends nothing more before the answer).
func readGreeting(head []byte, r io.Reader) (greeting, []byte, error) {
	var g greeting
	buf := slices.Clone(head)
	need := func(n int) error {
		if len(buf) >= n {
			return nil
		}
		more := make([]byte, n-len(buf))
		if _, err := io.ReadFull(r, more); err != nil {
			return err
		}
		buf = append(buf, more...)
		return nil
	}
	if err := need(greetingFixed); err != nil {
		return g, nil, err
	}
	if [4]byte(buf[:4]) != greetingMagic {
		return g, nil, fmt.Errorf("%w: bad magic %x", errBadGreeting, buf[:4])
	}
	if buf[4] != greetingVersion {
		return g, nil, fmt.Errorf("%w: version %d, this build reads %d", errBadGreeting, buf[4], greetingVersion)
	}
	g.settled = buf[5]&greetSettled != 0
	copy(g.id[:], buf[6:22])
	off := greetingFixed
	for _, dst := range []*string{&g.self, &g.addr} {
		if err := need(off + 2); err != nil {
			return g, nil, err
		}
		n := int(binary.BigEndian.Uint16(buf[off:]))
		if n > greetingMaxName {
			return g, nil, fmt.Errorf("%w: a name of %d bytes (at most %d)", errBadGreeting, n, greetingMaxName)
		}
		off += 2
		if err := need(off + n); err != nil {
			return g, nil, err
		}
		*dst = string(buf[off : off+n])
		off += n
	}
	return g, buf[off:], nil
}

// verdict decides whether an acceptor of identity me takes greeting g,
// and which id it then holds (me.id, or g's when it takes g's id).
func (me *identity) verdict(g greeting) (take bool, adopt bool) {
	switch {
	case g.id == me.id:
		return true, false
	case me.id.IsZero() && !me.provisional:
		return true, false // a directory of a build before greetings: unchecked
	case !me.provisional:
		return false, false
	case me.joiner:
		ok := me.id.IsZero() && g.settled && !g.id.IsZero()
		return ok, ok
	case me.listed != nil && me.listed(g.self, g.addr):
		return true, g.settled && !g.id.IsZero()
	}
	return false, false
}

// greetDial greets the acceptor of c, dialed to address, as id, within
// timeout: nil when it took the connection (confirmed when its answer
// names id's cluster), errUngreeted when it closed the connection
// unanswered (a build before greetings), an ErrForeignCluster when it
// refused it, any other error when the greeting could not be sent or its
// answer read.
func greetDial(c net.Conn, address string, id *identity, timeout time.Duration) (confirmed bool, err error) {
	if timeout > 0 {
		if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
			return false, err
		}
	}
	if _, err := c.Write(appendGreeting(make([]byte, 0, 64), id)); err != nil {
		return false, err
	}
	var reply [replyLen]byte
	if n, err := io.ReadFull(c, reply[:]); err != nil {
		switch {
		case n == 0 && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)):
			return false, errUngreeted
		case n > 0 && reply[0] == greetBusy:
			return false, fmt.Errorf("%w: %s", errBusy, address)
		}
		return false, fmt.Errorf("raft transport: read the answer to the greeting from %s: %w", address, err)
	}
	theirs := ClusterID(reply[1:])
	switch reply[0] {
	case greetTaken:
		if theirs == id.id {
			confirmed = true
		}
	case greetUnreadable:
		return false, fmt.Errorf("%w: %s reads greetings of version %d, this build writes %d", errBadGreeting, address, reply[1], greetingVersion)
	case greetRefused:
		return false, fmt.Errorf("%w: %s is a node of cluster %s, this node (%s) of cluster %s: "+
			"a raft address this cluster lists is served by another cluster's node (check the member's raft address, kvctl members list)",
			ErrForeignCluster, address, theirs, id.self, id.id)
	default:
		return false, fmt.Errorf("%w: answer %d from %s", errBadGreeting, reply[0], address)
	}
	if timeout > 0 {
		return confirmed, c.SetDeadline(time.Time{})
	}
	return confirmed, nil
}
