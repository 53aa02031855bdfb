package api

import (
	"encoding/json"
	"math"
	"strconv"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// A brief route answer is what a router asks for on every request, and
// encoding/json spends more on its reflection than on the bytes. It is
// written by hand here, byte for byte what json.Marshal(routeResponse(res,
// true)) gives: the same keys in the same order, numbers formatted as
// encoding/json formats them. What it cannot write that way (a float that
// is not finite, a string that would need escaping) it reports, and the
// caller falls back to encoding/json. The scoring parameters are encoded
// by encoding/json, once per distinct value. TestBriefRouteResponse*
// compare the two on random answers, and fail when RouteResponse gains a
// field this encoder does not know.

// paramsJSON caches the encoding of the last Params answered: the
// cluster's settings change rarely, and overrides are the exception.
type paramsJSON struct {
	p indexer.Params
	b []byte
}

var lastParams atomic.Pointer[paramsJSON]

func appendParams(dst []byte, p indexer.Params) ([]byte, bool) {
	if c := lastParams.Load(); c != nil && c.p == p && sameSigns(c.p, p) {
		return append(dst, c.b...), true
	}
	b, err := json.Marshal(p)
	if err != nil {
		return dst, false
	}
	lastParams.Store(&paramsJSON{p: p, b: b})
	return append(dst, b...), true
}

// sameSigns reports whether equal params also agree on the sign of each
// zero: 0 == -0, but encoding/json writes them apart (a client may send -0
// as an override).
func sameSigns(a, b indexer.Params) bool {
	fa := [...]float64{a.OverlapScoreCredit, a.HostCacheHitWeight, a.DiskCacheHitWeight, a.PrefillLoadScale,
		a.DecodeActiveRequestWeight, a.Temperature, a.BusyDecodeFraction}
	fb := [...]float64{b.OverlapScoreCredit, b.HostCacheHitWeight, b.DiskCacheHitWeight, b.PrefillLoadScale,
		b.DecodeActiveRequestWeight, b.Temperature, b.BusyDecodeFraction}
	for i := range fa {
		if math.Signbit(fa[i]) != math.Signbit(fb[i]) {
			return false
		}
	}
	return true
}

// appendBriefRouteResponse appends the JSON of routeResponse(res, true)
// to dst, without the trailing newline; false when it cannot (dst is then
// garbage).
func appendBriefRouteResponse(dst []byte, res *raftfsm.RouteResult) ([]byte, bool) {
	d := &res.Decision
	var overlap TierBlocks
	if c := d.Chosen(); c != nil {
		overlap = tierBlocks(c.Overlap)
	}
	decidedBy := d.DecidedBy.String()
	if !plainJSONString(decidedBy) {
		return dst, false
	}
	ok := true
	b := append(dst, `{"worker_id":`...)
	b = strconv.AppendUint(b, d.Rank.Worker, 10)
	b = append(b, `,"dp_rank":`...)
	b = strconv.AppendUint(b, uint64(d.Rank.DP), 10)
	b = append(b, `,"cost":`...)
	b, ok = appendJSONFloat(b, d.Cost)
	if !ok {
		return dst, false
	}
	b = append(b, `,"decided_by":"`...)
	b = append(b, decidedBy...)
	b = append(b, `","block_size":`...)
	b = strconv.AppendInt(b, int64(res.BlockSize), 10)
	b = append(b, `,"request_blocks":`...)
	b = strconv.AppendInt(b, d.RequestBlocks, 10)
	b = append(b, `,"booked":`...)
	b = strconv.AppendBool(b, res.Booked)
	b = append(b, `,"overlap":{"device":`...)
	b = strconv.AppendInt(b, overlap.Device, 10)
	b = append(b, `,"host":`...)
	b = strconv.AppendInt(b, overlap.Host, 10)
	b = append(b, `,"disk":`...)
	b = strconv.AppendInt(b, overlap.Disk, 10)
	b = append(b, `,"external":`...)
	b = strconv.AppendInt(b, overlap.External, 10)
	b = append(b, `},"params":`...)
	b, ok = appendParams(b, d.Params)
	if !ok {
		return dst, false
	}
	return append(b, '}'), true
}

// appendJSONFloat formats f as encoding/json does (float64): the shortest
// decimal that reads back as f, in exponent form below 1e-6 and from 1e21
// on, with a one-digit negative exponent where it has one. NaN and the
// infinities are not JSON: false.
func appendJSONFloat(b []byte, f float64) ([]byte, bool) {
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return b, false
	}
	abs := math.Abs(f)
	format := byte('f')
	if abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// clean up e-09 to e-9
		n := len(b)
		if n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b, true
}

// plainJSONString reports whether s is written as it is inside JSON quotes
// by encoding/json (printable ASCII, nothing it escapes, HTML included).
func plainJSONString(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20 || c >= 0x7f, c == '"', c == '\\', c == '<', c == '>', c == '&':
			return false
		}
	}
	return true
}
