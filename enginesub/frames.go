package enginesub

import (
	"encoding/binary"
	"math"

	"github.com/tinylib/msgp/msgp"
)

// endSeq is the sequence frame of the marker that ends a replay. It is never
// a batch's sequence.
const endSeq = ^uint64(0)

// Why a message was skipped as malformed; the metric's reason label.
const (
	badFrames    = "frames"    // wrong number of frames
	badSeq       = "seq"       // sequence frame not 8 bytes, or the end marker on the live stream
	badPayload   = "payload"   // the decoder rejected the payload
	badDelimiter = "delimiter" // a replay reply without the empty delimiter frame
)

var badReasons = [...]string{badFrames, badSeq, badPayload, badDelimiter}

// parseLive reads a live message: [topic, seq, payload]. The topic was
// matched by the SUB socket's filter.
func parseLive(frames [][]byte) (seq uint64, payload []byte, bad string) {
	if len(frames) != 3 {
		return 0, nil, badFrames
	}
	if len(frames[1]) != 8 {
		return 0, nil, badSeq
	}
	seq = binary.BigEndian.Uint64(frames[1])
	if seq == endSeq {
		return 0, nil, badSeq
	}
	return seq, frames[2], ""
}

// parseReply reads one message a DEALER receives from the engine's replay
// ROUTER: the empty delimiter frame, then [seq, payload] (older engines) or
// [topic, seq, payload] (newer). end reports the marker that ends the
// replay: sequence endSeq with an empty payload.
func parseReply(frames [][]byte) (seq uint64, payload []byte, end bool, bad string) {
	if len(frames) == 0 || len(frames[0]) != 0 {
		return 0, nil, false, badDelimiter
	}
	frames = frames[1:]
	switch len(frames) {
	case 2:
	case 3:
		frames = frames[1:] // the topic
	default:
		return 0, nil, false, badFrames
	}
	if len(frames[0]) != 8 {
		return 0, nil, false, badSeq
	}
	seq = binary.BigEndian.Uint64(frames[0])
	if seq == endSeq {
		if len(frames[1]) != 0 {
			return 0, nil, false, badSeq
		}
		return 0, nil, true, ""
	}
	return seq, frames[1], false, ""
}

// replayRequest is the request a DEALER sends for the batches from seq on:
// the empty delimiter a REQ socket would add, then the 8-byte big-endian
// start sequence.
func replayRequest(seq uint64) [][]byte {
	return [][]byte{{}, binary.BigEndian.AppendUint64(nil, seq)}
}

// payloadTS reads the publish time of a batch payload (wire.md: [ts, events,
// dp] or a map with key "ts"), without decoding the rest. ok is false when
// the payload has no readable, finite ts.
func payloadTS(b []byte) (ts float64, ok bool) {
	switch msgp.NextType(b) {
	case msgp.ArrayType:
		n, rest, err := msgp.ReadArrayHeaderBytes(b)
		if err != nil || n == 0 {
			return 0, false
		}
		return readTS(rest)
	case msgp.MapType:
		n, rest, err := msgp.ReadMapHeaderBytes(b)
		if err != nil {
			return 0, false
		}
		for range n {
			var k []byte
			if k, rest, err = msgp.ReadStringZC(rest); err != nil {
				return 0, false
			}
			if string(k) == "ts" {
				return readTS(rest)
			}
			if rest, err = msgp.Skip(rest); err != nil {
				return 0, false
			}
		}
	}
	return 0, false
}

func readTS(b []byte) (float64, bool) {
	var ts float64
	var err error
	switch msgp.NextType(b) {
	case msgp.Float64Type:
		ts, _, err = msgp.ReadFloat64Bytes(b)
	case msgp.Float32Type:
		var f float32
		f, _, err = msgp.ReadFloat32Bytes(b)
		ts = float64(f)
	case msgp.IntType:
		var i int64
		i, _, err = msgp.ReadInt64Bytes(b)
		ts = float64(i)
	case msgp.UintType:
		var u uint64
		u, _, err = msgp.ReadUint64Bytes(b)
		ts = float64(u)
	default:
		return 0, false
	}
	if err != nil || math.IsNaN(ts) || math.IsInf(ts, 0) {
		return 0, false
	}
	return ts, true
}
