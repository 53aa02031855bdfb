package eventplane

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

// FuzzDecodeHeartbeatAnswer: the leader's answer, body and the
// ranks-without-state header, is outside bytes to an agent. Nothing panics;
// a refused body or an unreadable rank is ErrMalformed; ranks of an answer
// read whole (Named) encode back, as the leader writes them, to the same
// ranks.
func FuzzDecodeHeartbeatAnswer(f *testing.F) {
	f.Add(AppendHeartbeat(nil, []uint64{1}), "1/0 2/3", true)
	f.Add([]byte{}, "", true)
	f.Add([]byte{1}, "x", true)
	f.Add([]byte{}, "1/ 2/4294967296 18446744073709551616/0 3", true)
	f.Add([]byte{}, "", false)
	f.Fuzz(func(t *testing.T, body []byte, h string, withHeader bool) {
		m := &nats.Msg{Data: body}
		if withHeader {
			m.Header = nats.Header{headerRanksWithoutState: []string{h}}
		}
		a, err := DecodeHeartbeatAnswer(m)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("body error %v, not ErrMalformed", err)
			}
			return
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
		var parts []string
		for _, r := range a.Stateless {
			parts = append(parts, strconv.FormatUint(r.Worker, 10)+"/"+strconv.FormatUint(uint64(r.DP), 10))
		}
		b, err := DecodeHeartbeatAnswer(&nats.Msg{Header: nats.Header{headerRanksWithoutState: []string{strings.Join(parts, " ")}}})
		if err != nil || !b.Named || !slices.Equal(b.Stateless, a.Stateless) {
			t.Fatalf("%q: %v re-read as %v (%v)", h, a.Stateless, b.Stateless, err)
		}
	})
}
