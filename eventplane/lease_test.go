package eventplane

import (
	"errors"
	"slices"
	"testing"
)

// TestHeartbeatEncoding: ids round-trip; a body that is not a list of
// 8-byte ids is refused as malformed, whatever its length.
func TestHeartbeatEncoding(t *testing.T) {
	ids := []uint64{1, 1 << 63, 42}
	got, err := DecodeHeartbeat(AppendHeartbeat(nil, ids))
	if err != nil || !slices.Equal(got, ids) {
		t.Fatalf("round trip: %v %v", got, err)
	}
	if got, err := DecodeHeartbeat(nil); err != nil || len(got) != 0 {
		t.Fatalf("empty heartbeat: %v %v", got, err)
	}
	for n := 1; n < 8; n++ {
		if _, err := DecodeHeartbeat(make([]byte, 8+n)); !errors.Is(err, ErrMalformed) {
			t.Fatalf("%d bytes: %v, want ErrMalformed", 8+n, err)
		}
	}
}

// FuzzDecodeHeartbeat: any bytes from NATS either decode to ids that
// encode back to the same bytes or are refused as malformed.
func FuzzDecodeHeartbeat(f *testing.F) {
	f.Add(AppendHeartbeat(nil, []uint64{1, 1 << 63}))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		ids, err := DecodeHeartbeat(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v is not ErrMalformed", err)
			}
			return
		}
		if got := AppendHeartbeat(nil, ids); !slices.Equal(got, b) {
			t.Fatalf("%x decodes to %v, which encodes to %x", b, ids, got)
		}
	})
}
