package api

import (
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestEventBlocksAreBounded: an event takes at most 2^20 blocks (stored)
// or hashes (removed), the only bound on them before the body limit; one
// more is refused 400 invalid, and reaches neither the node nor its Raft
// log.
func TestEventBlocksAreBounded(t *testing.T) {
	const bound = 1 << 20 // maxBlockLen, written out: raising it must fail here
	rank := kvevent.Rank{Worker: 1}
	for _, n := range []int{bound, bound + 1} {
		blocks := make([]Block, n)
		hashes := make([]uint64, n)
		for i := range blocks {
			blocks[i] = Block{Hash: uint64(i) + 1, LocalHash: uint64(i) + 1}
			hashes[i] = uint64(i) + 1
		}
		for _, e := range []Event{
			{EventID: 1, Type: EventStored, Tier: "device", Blocks: blocks},
			{EventID: 1, Type: EventRemoved, Tier: "device", Hashes: hashes},
		} {
			_, err := e.toKV(rank)
			switch {
			case n <= bound && err != nil:
				t.Errorf("a %s event of %d blocks: %v, want it taken", e.Type, n, err)
			case n > bound && (err == nil || !strings.Contains(err.Error(), "more than 1048576 blocks")):
				t.Errorf("a %s event of %d blocks: %v, want it refused naming the bound", e.Type, n, err)
			}
			if err != nil {
				if code, reason := classify(err); code != 400 || reason != ReasonInvalid {
					t.Errorf("a %s event of %d blocks: %d %s, want 400 invalid", e.Type, n, code, reason)
				}
			}
		}
	}
}

// FuzzPathParameters: a path parameter is taken as a worker id (64 bits)
// or a dp rank (32) exactly when strconv reads it as an unsigned decimal
// of that size, and as an id (a request's, a member's) exactly when it is
// 1 to 256 bytes of UTF-8 without a control character; anything refused
// is 400 invalid, with the value quoted in the message.
func FuzzPathParameters(f *testing.F) {
	for _, s := range []string{
		"", "0", "1", "01", "+1", "-1", " 1", "1 ", "0x10", "1e3", "1_000",
		"4294967295", "4294967296", "18446744073709551615", "18446744073709551616",
		"r-1", "a/b", "a%2Fb", "é", "\x00", "a\tb", "\u0085", "\xff", strings.Repeat("i", 256), strings.Repeat("i", 257),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, bits := range []int{64, 32} {
			v, err := parseUint("worker id", s, bits)
			w, werr := strconv.ParseUint(s, 10, bits)
			if (err == nil) != (werr == nil) || (err == nil && v != w) {
				t.Fatalf("parseUint(%q, %d) = %d, %v; strconv: %d, %v", s, bits, v, err, w, werr)
			}
			if err != nil {
				if code, reason := classify(err); code != 400 || reason != ReasonInvalid || !strings.Contains(err.Error(), strconv.Quote(s)) {
					t.Fatalf("parseUint(%q, %d): %d %s %q, want 400 invalid quoting it", s, bits, code, reason, err)
				}
			}
		}
		err := checkID("request id", s)
		control := strings.IndexFunc(s, unicode.IsControl) >= 0
		want := s != "" && len(s) <= 256 && utf8.ValidString(s) && !control
		if (err == nil) != want {
			t.Fatalf("checkID(%q) = %v; want taken %v", s, err, want)
		}
		if err != nil {
			if code, reason := classify(err); code != 400 || reason != ReasonInvalid {
				t.Fatalf("checkID(%q): %d %s, want 400 invalid", s, code, reason)
			}
		}
	})
}
