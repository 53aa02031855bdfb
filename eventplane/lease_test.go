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
