package eventplane

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// The wire format (docs/events.md): every message starts with the magic
// bytes 'K','E', a version byte and a message type byte. Integers are
// unsigned LEB128 varints except hashes and incarnations, which are fixed
// 8-byte little endian (they are uniformly random: a varint would be
// longer).
//
// Version 2 adds the publisher incarnation to events requests (per rank
// batch, after its rank) and dumps (after the rank). Publishers send
// version 2; the ingester still takes version 1 requests, from agents of
// earlier builds, as incarnation 0 (unfenced). Replies are the same in both
// versions and go out as version 1, which every publisher reads; a reader
// takes either.
const (
	wireMagic0    = 'K'
	wireMagic1    = 'E'
	wireVersion   = 2 // requests are written in it
	wireVersionV1 = 1 // before incarnations; replies are written in it

	msgEvents = 1 // request: rank batches
	msgDump   = 2 // request: one rank's full state
	msgAcks   = 3 // reply: one ack per rank batch, in request order
	msgError  = 4 // reply: an error code and a message
	msgDumpOK = 5 // reply: the dump is committed
)

// Flags of an ack (one byte; publishers of earlier builds know only
// ackGap, or ackGap and ackResync, and refuse a reply with a flag they do
// not know). ackFenced answers a fenced batch only, which carries an
// incarnation: only a publisher that knows the flag gets it. ackUnregistered
// goes only to a publisher that says it reads it (headerAckFlags): every
// publisher sends version 2, with or without knowing it.
const (
	ackGap          = 1 << 0 // RankAck.Gap
	ackResync       = 1 << 1 // RankAck.Resync
	ackFenced       = 1 << 2 // RankAck.Fenced
	ackUnregistered = 1 << 3 // RankAck.Unregistered

	// ackFlagsBase are the flags every publisher that sends version 2
	// reads; ackFlagsKnown, every flag this build reads and writes.
	ackFlagsBase  = ackGap | ackResync | ackFenced
	ackFlagsKnown = ackFlagsBase | ackUnregistered
)

// Error codes of an error reply.
const (
	codeNotLeader = 1 // this node does not lead (any more): resend
	codeInvalid   = 2 // the request is malformed: do not resend it as is
	codeInternal  = 3 // the commit failed or timed out: resend
	// codeUnregistered answers a dump of a rank that its Positional worker
	// does not list (raftfsm.ErrUnregisteredRank): nothing applied; resend
	// after a backoff. Only a publisher whose request announced
	// ackUnregistered (headerAckFlags) gets it; another gets codeInvalid,
	// which every publisher backs off from (Ingester.onDump).
	codeUnregistered = 4
)

var (
	// ErrMalformed means a message could not be decoded.
	ErrMalformed = errors.New("malformed event-plane message")
	// ErrFull means a rank's replay buffer has no room for the events.
	ErrFull = errors.New("replay buffer full")
	// ErrTooLarge means a batch has more events than a rank's replay
	// buffer holds at all (PublisherConfig.BufferEvents): it can never be
	// taken, and PublishWait returns it at once. It is an ErrFull.
	ErrTooLarge = fmt.Errorf("%w: batch larger than the buffer", ErrFull)
	// ErrClosed means the publisher or ingester is closed.
	ErrClosed = errors.New("closed")
)

// ReplyError is an error reply from the ingester.
type ReplyError struct {
	Code uint8
	Msg  string
}

func (e *ReplyError) Error() string { return fmt.Sprintf("ingester error %d: %s", e.Code, e.Msg) }

// ---- encoding ----

type wbuf struct{ b []byte }

func (w *wbuf) uv(v uint64)  { w.b = binary.AppendUvarint(w.b, v) }
func (w *wbuf) u64(v uint64) { w.b = binary.LittleEndian.AppendUint64(w.b, v) }
func (w *wbuf) byte1(v byte) { w.b = append(w.b, v) }
func (w *wbuf) header(version, typ byte) {
	w.b = append(w.b, wireMagic0, wireMagic1, version, typ)
}

// eventSize is an upper bound of an event's encoded size.
func eventSize(ev *kvevent.Event) int {
	return 2 + 1 + 8 + 10 + 16*len(ev.Blocks) + 10 + 8*len(ev.Removed)
}

func (w *wbuf) event(ev *kvevent.Event) {
	w.byte1(byte(ev.Tier))
	w.byte1(byte(ev.Kind))
	switch ev.Kind {
	case kvevent.KindStored:
		if ev.HasParent {
			w.byte1(1)
			w.u64(ev.Parent)
		} else {
			w.byte1(0)
		}
		w.uv(uint64(len(ev.Blocks)))
		for _, b := range ev.Blocks {
			w.u64(b.EngineHash)
			w.u64(b.LocalHash)
		}
	case kvevent.KindRemoved:
		w.uv(uint64(len(ev.Removed)))
		for _, h := range ev.Removed {
			w.u64(h)
		}
	}
}

// appendEvents encodes an events request (version 2: each batch with its
// incarnation). Each batch's events must carry consecutive ids; only the
// first id travels.
func appendEvents(dst []byte, batches []raftfsm.RankBatch) []byte {
	w := wbuf{dst}
	w.header(wireVersion, msgEvents)
	w.uv(uint64(len(batches)))
	for i := range batches {
		b := &batches[i]
		w.uv(b.Rank.Worker)
		w.uv(uint64(b.Rank.DP))
		w.u64(b.Incarnation)
		first := uint64(0)
		if len(b.Events) > 0 {
			first = b.Events[0].EventID
		}
		w.uv(first)
		w.uv(uint64(len(b.Events)))
		for j := range b.Events {
			w.event(&b.Events[j])
		}
	}
	return w.b
}

// A dumpRequest is a decoded dump request: rank's Stored events, which
// make its whole state as of event id cursor, sent by publisher
// incarnation incarnation (0: unfenced, a version 1 request).
type dumpRequest struct {
	rank        kvevent.Rank
	incarnation uint64
	cursor      uint64
	stored      []kvevent.Event
}

// appendDump encodes a dump request (version 2).
func appendDump(dst []byte, d *dumpRequest) []byte {
	w := wbuf{dst}
	w.header(wireVersion, msgDump)
	w.uv(d.rank.Worker)
	w.uv(uint64(d.rank.DP))
	w.u64(d.incarnation)
	w.uv(d.cursor)
	stored := d.stored
	w.uv(uint64(len(stored)))
	for i := range stored {
		w.event(&stored[i])
	}
	return w.b
}

// appendAcks encodes an acks reply. readable is the set of flags the
// requesting publisher reads (ackFlagsBase, plus what its headerAckFlags
// announced): a flag outside it is left out, so that a publisher of an
// earlier build still decodes the reply. An ack left without its
// Unregistered flag reads as cursor 0, nothing applied, which such a
// publisher resends with backoff (sendEvents: an ack that moved nothing).
func appendAcks(dst []byte, acks []raftfsm.RankAck, readable byte) []byte {
	w := wbuf{dst}
	w.header(wireVersionV1, msgAcks)
	w.uv(uint64(len(acks)))
	for _, a := range acks {
		w.uv(a.Rank.Worker)
		w.uv(uint64(a.Rank.DP))
		w.uv(a.Cursor)
		w.uv(uint64(a.Applied))
		w.uv(uint64(a.Dups))
		var flags byte
		if a.Gap {
			flags |= ackGap
		}
		if a.Resync {
			flags |= ackResync
		}
		if a.Fenced {
			flags |= ackFenced
		}
		if a.Unregistered {
			flags |= ackUnregistered
		}
		w.byte1(flags & readable)
	}
	return w.b
}

func appendError(dst []byte, code uint8, msg string) []byte {
	w := wbuf{dst}
	w.header(wireVersionV1, msgError)
	w.byte1(code)
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	w.uv(uint64(len(msg)))
	w.b = append(w.b, msg...)
	return w.b
}

func appendDumpOK(dst []byte, cursor uint64) []byte {
	w := wbuf{dst}
	w.header(wireVersionV1, msgDumpOK)
	w.uv(cursor)
	return w.b
}

// ---- decoding ----

// rbuf reads a message; the first failure sticks and later reads return
// zero values, so decoders check err once per loop iteration.
type rbuf struct {
	b   []byte
	err error

	// blocks and removed are the arrays a message's events take their
	// Blocks and Removed from: one of each per message instead of one per
	// event (the leader decodes every events request). Each is made at its
	// first use with room for what the bytes left can hold, which bounds
	// every later count, so neither grows; each is at most the message's
	// size, the room a request mixing both kinds leaves unused included
	// (held counts it for the ingester's queue bound). The events share
	// them for as long as any of them is held.
	blocks  []kvevent.Block
	removed []uint64
	held    int // bytes of the arrays above
}

// slab returns n elements after the slab's length; the first call makes
// the slab room for all that the message's rest bytes can hold, elements
// of size bytes each on the wire and in memory (a Block, a hash). held
// counts the bytes it allocated.
func slab[T any](s *[]T, n, rest, size int, held *int) []T {
	if n == 0 {
		return nil
	}
	if cap(*s)-len(*s) < n {
		c := max(n, rest/size)
		*s = make([]T, 0, c)
		*held += c * size
	}
	l := len(*s)
	*s = (*s)[:l+n]
	return (*s)[l : l+n : l+n]
}

func (r *rbuf) fail(format string, a ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, a...)...)
	}
}

func (r *rbuf) uv() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *rbuf) u64() uint64 {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 8 {
		r.fail("truncated")
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *rbuf) byte1() byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 1 {
		r.fail("truncated")
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

// count reads a length whose elements take at least minSize bytes each, so
// that a forged length can never make the decoder allocate more than the
// message justifies.
func (r *rbuf) count(minSize int) int {
	n := r.uv()
	if r.err != nil {
		return 0
	}
	if n > uint64(len(r.b)/minSize) {
		r.fail("count %d exceeds the message", n)
		return 0
	}
	return int(n)
}

func (r *rbuf) dp() uint32 {
	v := r.uv()
	if v > math.MaxUint32 {
		r.fail("dp rank %d out of range", v)
	}
	return uint32(v)
}

// header reads a message's header and returns its version and type.
func (r *rbuf) header() (version, typ byte) {
	if r.byte1() != wireMagic0 || r.byte1() != wireMagic1 {
		r.fail("bad magic")
	}
	v := r.byte1()
	if r.err == nil && v != wireVersion && v != wireVersionV1 {
		r.fail("unsupported version %d (this build reads %d and %d)", v, wireVersionV1, wireVersion)
	}
	return v, r.byte1()
}

func (r *rbuf) event(ev *kvevent.Event) {
	ev.Tier = kvevent.Tier(r.byte1())
	ev.Kind = kvevent.Kind(r.byte1())
	switch ev.Kind {
	case kvevent.KindStored:
		switch r.byte1() {
		case 0:
		case 1:
			ev.HasParent = true
			ev.Parent = r.u64()
		default:
			r.fail("bad parent flag")
		}
		n := r.count(16)
		if r.err != nil {
			return
		}
		ev.Blocks = slab(&r.blocks, n, len(r.b), 16, &r.held)
		for i := range ev.Blocks {
			ev.Blocks[i] = kvevent.Block{EngineHash: r.u64(), LocalHash: r.u64()}
		}
	case kvevent.KindRemoved:
		n := r.count(8)
		if r.err != nil {
			return
		}
		ev.Removed = slab(&r.removed, n, len(r.b), 8, &r.held)
		for i := range ev.Removed {
			ev.Removed[i] = r.u64()
		}
	}
	if r.err == nil {
		if err := ev.Validate(); err != nil {
			r.fail("%v", err)
		}
	}
}

func (r *rbuf) end() {
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
}

// msgType returns a message's type after checking its header.
func msgType(b []byte) (byte, error) {
	r := rbuf{b: b}
	_, t := r.header()
	return t, r.err
}

// decodeEvents decodes an events request of at most maxEvents events.
// Every event is structurally valid (kvevent.Event.Validate) and carries
// its rank and id; each batch carries its incarnation (0 in a version 1
// request). The cap is checked before the events are allocated: a decoded
// event is far larger than the 2 bytes it may be sent in.
func decodeEvents(b []byte, maxEvents int) ([]raftfsm.RankBatch, error) {
	batches, _, err := decodeEventsHeld(b, maxEvents)
	return batches, err
}

// decodeEventsHeld is decodeEvents that also returns the bytes of memory
// the decoded batches hold: their arrays of batches, events, blocks and
// removed hashes.
func decodeEventsHeld(b []byte, maxEvents int) (batches []raftfsm.RankBatch, held int, err error) {
	r := rbuf{b: b}
	v, t := r.header()
	if r.err == nil && t != msgEvents {
		r.fail("message type %d, want events", t)
	}
	nb := r.count(4)
	switch {
	case r.err != nil:
	case nb == 0:
		// Nothing to apply, yet a queue slot and an acknowledgement.
		r.fail("a request of no rank batch")
	case nb > maxEvents:
		// Every batch holds an event: refused before the batches are
		// allocated (40 bytes each, against 4 on the wire).
		r.fail("request of more than %d events", maxEvents)
	}
	if r.err != nil {
		return nil, 0, r.err
	}
	batches = make([]raftfsm.RankBatch, 0, nb)
	held = nb * sizeBatch
	total := 0
	for i := 0; i < nb && r.err == nil; i++ {
		rank := kvevent.Rank{Worker: r.uv(), DP: r.dp()}
		var inc uint64
		if v >= wireVersion {
			if inc = r.u64(); inc == raftfsm.PositionalIncarnation {
				// The compatible API's batches of positions (raftfsm).
				r.fail("incarnation %d is reserved", inc)
				break
			}
		}
		first := r.uv()
		ne := r.count(2)
		if r.err != nil {
			break
		}
		if ne == 0 {
			// A publisher never sends one, and each would cost a decoded
			// batch, a queue slot and a Raft apply for free (the caps
			// count events).
			r.fail("an empty rank batch")
			break
		}
		if total += ne; total > maxEvents {
			r.fail("request of more than %d events", maxEvents)
			break
		}
		if ne > 0 && (first == 0 || first > math.MaxUint64-uint64(ne)) {
			r.fail("first event id %d", first)
			break
		}
		evs := make([]kvevent.Event, ne)
		held += ne * sizeEvent
		for j := range evs {
			evs[j].Rank, evs[j].EventID = rank, first+uint64(j)
			r.event(&evs[j])
			if r.err != nil {
				break
			}
		}
		batches = append(batches, raftfsm.RankBatch{Rank: rank, Incarnation: inc, Events: evs})
	}
	r.end()
	if r.err != nil {
		return nil, 0, r.err
	}
	return batches, held + r.held, nil
}

// minStoredBytes is the least a stored event is encoded in: tier, kind,
// parent flag, block count and one block.
const minStoredBytes = 4 + 16

// decodeDump decodes a dump request (incarnation 0 in version 1).
func decodeDump(b []byte) (dumpRequest, error) {
	r := rbuf{b: b}
	v, t := r.header()
	if r.err == nil && t != msgDump {
		r.fail("message type %d, want dump", t)
	}
	var d dumpRequest
	d.rank = kvevent.Rank{Worker: r.uv(), DP: r.dp()}
	if v >= wireVersion {
		if d.incarnation = r.u64(); d.incarnation == raftfsm.PositionalIncarnation {
			r.fail("incarnation %d is reserved", d.incarnation) // as an events request's
		}
	}
	d.cursor = r.uv()
	// A stored event takes at least minStoredBytes: a forged count can
	// make the decoder allocate no more than the message justifies.
	n := r.count(minStoredBytes)
	if r.err == nil {
		d.stored = make([]kvevent.Event, n)
	}
	for i := range d.stored {
		d.stored[i].Rank = d.rank
		r.event(&d.stored[i])
		if r.err == nil && d.stored[i].Kind != kvevent.KindStored {
			r.fail("a dump holds only stored events")
		}
		if r.err != nil {
			break
		}
	}
	r.end()
	if r.err != nil {
		return dumpRequest{}, r.err
	}
	return d, nil
}

// decodeReply decodes an ingester reply: acks, a dump confirmation
// (cursor) or an error (*ReplyError).
func decodeReply(b []byte) (acks []raftfsm.RankAck, cursor uint64, err error) {
	r := rbuf{b: b}
	switch _, t := r.header(); {
	case r.err != nil:
	case t == msgAcks:
		n := r.count(6)
		acks = make([]raftfsm.RankAck, 0, n)
		for i := 0; i < n && r.err == nil; i++ {
			a := raftfsm.RankAck{Rank: kvevent.Rank{Worker: r.uv(), DP: r.dp()}, Cursor: r.uv()}
			applied, dups := r.uv(), r.uv()
			if applied > math.MaxInt32 || dups > math.MaxInt32 {
				r.fail("ack counts")
			}
			a.Applied, a.Dups = int(applied), int(dups)
			flags := r.byte1()
			if flags&^ackFlagsKnown != 0 {
				r.fail("bad ack flags %#x", flags)
			}
			a.Gap, a.Resync, a.Fenced = flags&ackGap != 0, flags&ackResync != 0, flags&ackFenced != 0
			a.Unregistered = flags&ackUnregistered != 0
			acks = append(acks, a)
		}
	case t == msgDumpOK:
		cursor = r.uv()
	case t == msgError:
		code := r.byte1()
		n := r.count(1)
		var msg string
		if r.err == nil {
			msg = string(r.b[:n])
			r.b = r.b[n:]
		}
		r.end()
		if r.err == nil {
			return nil, 0, &ReplyError{Code: code, Msg: msg}
		}
	default:
		r.fail("message type %d, want a reply", t)
	}
	r.end()
	if r.err != nil {
		return nil, 0, r.err
	}
	return acks, cursor, nil
}

// decodeAnswer decodes the reply to a request that is answered by
// messages of type want (msgAcks for events, msgDumpOK for a dump) or an
// error: a reply of any other type is malformed. decodeReply alone takes
// either, and an acks message in answer to a dump read as that dump
// committed at cursor 0 (from the event-plane review).
func decodeAnswer(b []byte, want byte) (acks []raftfsm.RankAck, cursor uint64, err error) {
	r := rbuf{b: b}
	if _, t := r.header(); r.err == nil && t != want && t != msgError {
		return nil, 0, fmt.Errorf("%w: message type %d in answer to a request answered by type %d", ErrMalformed, t, want)
	}
	return decodeReply(b)
}

// ---- the published-times header ----

// headerPublished is the NATS header of an events request that says, for
// each rank batch in order, when its publisher was handed the batch's first
// event: unix microseconds in decimal, comma-separated, 0 for unknown. The
// leader measures kvrouter_events_lag_seconds from it. It is a header, not
// part of the body, so that a router that does not know it ignores it and a
// publisher that does not send it is still understood.
const headerPublished = "Kvrouter-Published"

// headerAckFlags is the NATS header by which an events request says which
// ack flags beyond ackFlagsBase its publisher reads: their bits, in
// decimal. The leader sets those flags only for a request that announces
// them, so a publisher of an earlier build (no header) never gets a flag
// it would refuse the reply for, and a router of an earlier build ignores
// the header (agents and routers upgrade in any order).
const headerAckFlags = "Kvrouter-Ack-Flags"

// ackFlagsHeader is the value a publisher of this build sends.
var ackFlagsHeader = strconv.Itoa(ackFlagsKnown &^ ackFlagsBase)

// parseAckFlags returns the flags a request's publisher reads, from its
// headerAckFlags value: ackFlagsBase, plus the known flags the value
// announces. A missing or malformed value announces nothing.
func parseAckFlags(v string) byte {
	n, err := strconv.ParseUint(v, 10, 8)
	if err != nil {
		return ackFlagsBase
	}
	return ackFlagsBase | byte(n)&ackFlagsKnown
}

// appendPublished appends the header value for times.
func appendPublished(b []byte, times []uint64) []byte {
	for i, t := range times {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, t, 10)
	}
	return b
}

// parsePublished parses a header value into times (reusing its room). It
// returns false for a malformed value or one whose count is not n: the
// header only feeds a metric, so a bad one is ignored, not refused.
func parsePublished(v string, n int, times []uint64) ([]uint64, bool) {
	times = times[:0]
	for len(v) > 0 && len(times) < n {
		i := strings.IndexByte(v, ',')
		field := v
		if i >= 0 {
			field, v = v[:i], v[i+1:]
		} else {
			v = ""
		}
		t, err := strconv.ParseUint(field, 10, 64)
		if err != nil {
			return times[:0], false
		}
		times = append(times, t)
	}
	if len(v) > 0 || len(times) != n {
		return times[:0], false
	}
	return times, true
}
