package raftfsm

import (
	"reflect"
	"testing"
)

// TestWorkerEncodingRoundTrip: a registration with every field decodes to
// itself, and one encoded before extension 1 (ending after the model)
// still decodes, with the compatible APIs' fields empty.
func TestWorkerEncodingRoundTrip(t *testing.T) {
	full := WorkerInfo{ID: 1<<63 | 7, DPRanks: []uint32{0, 3}, BlockSize: 16, Capacity: [4]int64{10, 20, 0, -1},
		Endpoint: "http://w:8000", Model: "llama", Tenant: "blue", Instance: 42,
		EventEndpoints:  map[uint32]string{0: "tcp://w:5557", 3: "tcp://w:5560"},
		ReplayEndpoints: map[uint32]string{3: "tcp://w:5570"}, Salt: "s", LeaseMs: 10000, Positional: true}
	c, err := decodeCommand(encodeRegister(9, &full))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.worker, full) {
		t.Fatalf("decoded %+v\nwant    %+v", c.worker, full)
	}
	// Equal maps encode to equal bytes, whatever their iteration order.
	first := string(encodeRegister(9, &full))
	for i := 0; i < 20; i++ {
		if again := string(encodeRegister(9, &full)); again != first {
			t.Fatal("the encoding depends on map order")
		}
	}

	old := WorkerInfo{ID: 5, DPRanks: []uint32{0}, BlockSize: 16, Endpoint: "e", Model: "m"}
	var e enc
	encodeHeader(&e, cmdRegister, 9)
	encodeWorker(&e, &old)
	b := e.b[:len(e.b)-8] // drop extension 1: its marker byte, empty tenant, instance 0, two empty maps, empty salt, lease 0, not positional
	if b[len(b)-1] != 'm' {
		t.Fatalf("extension 1 is not 8 bytes here: %x", e.b)
	}
	c, err = decodeCommand(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.worker, old) {
		t.Fatalf("old encoding decoded %+v, want %+v", c.worker, old)
	}
	// An unknown extension is refused, not misread.
	bad := append(append([]byte(nil), b...), 2)
	if _, err := decodeCommand(bad); err == nil {
		t.Fatal("extension 2 decoded")
	}
}
