package eventplane

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/nats-io/nats.go"
)

// FuzzDecodeHeartbeatAnswer: the leader's answer, body, the
// ranks-without-state header and the needing-resync header, is outside
// bytes to an agent. Nothing panics; a refused body or an unreadable rank
// is ErrMalformed; the needing-resync header, whatever it holds, leaves
// what the answer says of the ranks without state (Named, Stateless,
// Unreadable) as it is without it; ranks of a header read whole encode
// back, as the leader writes them, to the same ranks.
func FuzzDecodeHeartbeatAnswer(f *testing.F) {
	f.Add(AppendHeartbeat(nil, []uint64{1}), "1/0 2/3", true, "", false)
	f.Add([]byte{}, "", true, "", false)
	f.Add([]byte{1}, "x", true, "", false)
	f.Add([]byte{}, "1/ 2/4294967296 18446744073709551616/0 3", true, "", false)
	f.Add([]byte{}, "", false, "", false)
	f.Add(AppendHeartbeat(nil, nil), "", true, "7/0 7/1", true)
	f.Add(AppendHeartbeat(nil, nil), "", true, "7/0:tier=g2", true)
	f.Add(AppendHeartbeat(nil, nil), "1/0", true, "1/ 2/4294967296 x 3/1", true)
	f.Add(AppendHeartbeat(nil, []uint64{1}), "8/1:tier=g2", true, "7/0 x", true)
	f.Add(AppendHeartbeat(nil, nil), "", false, "7/0", true)
	f.Fuzz(func(t *testing.T, body []byte, h string, withHeader bool, rh string, withResync bool) {
		m := &nats.Msg{Data: body, Header: nats.Header{}}
		if withHeader {
			m.Header[headerRanksWithoutState] = []string{h}
		}
		if withResync {
			m.Header[headerRanksNeedingResync] = []string{rh}
		}
		a, err := DecodeHeartbeatAnswer(m)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("body error %v, not ErrMalformed", err)
			}
			return
		}
		if withResync {
			without := &nats.Msg{Data: body, Header: nats.Header{}}
			if withHeader {
				without.Header[headerRanksWithoutState] = []string{h}
			}
			b, _ := DecodeHeartbeatAnswer(without)
			if a.Named != b.Named || !slices.Equal(a.Stateless, b.Stateless) || (a.Unreadable == nil) != (b.Unreadable == nil) {
				t.Fatalf("the needing-resync header %q changed the ranks without state's reading: named %v, %v, unreadable %v; without it named %v, %v, unreadable %v",
					rh, a.Named, a.Stateless, a.Unreadable, b.Named, b.Stateless, b.Unreadable)
			}
			if a.ResyncNamed != (a.ResyncUnreadable == nil) {
				t.Fatalf("resync named %v with unreadable %v", a.ResyncNamed, a.ResyncUnreadable)
			}
			if a.ResyncUnreadable != nil && !errors.Is(a.ResyncUnreadable, ErrMalformed) {
				t.Fatalf("resync unreadable %v, not ErrMalformed", a.ResyncUnreadable)
			}
			if a.ResyncUnreadable == nil {
				b, err := DecodeHeartbeatAnswer(&nats.Msg{Header: nats.Header{headerRanksNeedingResync: []string{encodeRanks(a.Resync)}}})
				if err != nil || b.ResyncUnreadable != nil || !slices.Equal(b.Resync, a.Resync) {
					t.Fatalf("resync %q: %v re-read as %v (%v)", rh, a.Resync, b.Resync, err)
				}
			}
		} else if a.Resync != nil || a.ResyncUnreadable != nil || a.ResyncNamed {
			t.Fatalf("no needing-resync header but resync %v, unreadable %v, named %v", a.Resync, a.ResyncUnreadable, a.ResyncNamed)
		}
		if a.Unreadable != nil {
			if !errors.Is(a.Unreadable, ErrMalformed) || a.Named {
				t.Fatalf("unreadable %v, named %v", a.Unreadable, a.Named)
			}
			return
		}
		if !withHeader {
			if a.Named || a.Stateless != nil {
				t.Fatalf("no header but named %v, %v", a.Named, a.Stateless)
			}
			return
		}
		if !a.Named {
			t.Fatalf("header %q read whole but not Named", h)
		}
		b, err := DecodeHeartbeatAnswer(&nats.Msg{Header: nats.Header{headerRanksWithoutState: []string{encodeRanks(a.Stateless)}}})
		if err != nil || !b.Named || !slices.Equal(b.Stateless, a.Stateless) {
			t.Fatalf("%q: %v re-read as %v (%v)", h, a.Stateless, b.Stateless, err)
		}
	})
}

// encodeRanks writes ranks as the leader writes a header's.
func encodeRanks(ranks []kvevent.Rank) string {
	var parts []string
	for _, r := range ranks {
		parts = append(parts, strconv.FormatUint(r.Worker, 10)+"/"+strconv.FormatUint(uint64(r.DP), 10))
	}
	return strings.Join(parts, " ")
}
