package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"strings"

	"github.com/kvrouter/kvrouter/internal/strictkeys"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TraceBlockTokens is the block size of Mooncake traces: each hash id
// stands for 512 prompt tokens and everything before them.
const TraceBlockTokens = 512

// ErrBadTrace means a trace line is not a valid request.
var ErrBadTrace = errors.New("bad trace")

// Request is one trace row.
type Request struct {
	TimestampMs  int64    `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// Bounds of a trace row: a timestamp past MaxTraceTimestampMs (139
// years; epoch milliseconds still pass) would overflow the simulated
// clock, and a length past MaxTraceTokens (16 Mi tokens; the largest row
// of the shared traces has 191,378) would have Prepare build that many
// token ids for one line before anything runs.
const (
	MaxTraceTimestampMs = 1 << 42
	MaxTraceTokens      = 1 << 24
)

// MaxTraceLineBytes bounds a trace line (64 MiB), so that a file without
// newlines is not read whole into memory: a row of MaxTraceTokens takes
// 32,768 hash ids, under 1 MiB however they are written.
const MaxTraceLineBytes = 64 << 20

// traceRow is a trace line as written: a field left out stays nil, so
// that a missing field is told from a zero.
type traceRow struct {
	TimestampMs  *int64    `json:"timestamp"`
	InputLength  *int      `json:"input_length"`
	OutputLength *int      `json:"output_length"`
	HashIDs      *[]uint64 `json:"hash_ids"`
}

// ReadTrace parses a Mooncake JSONL trace (traces/README.md). Each
// line is one object with exactly the fields timestamp, input_length,
// output_length and hash_ids, each once and spelled exactly (letter case
// included), and ceil(input_length / 512) hash ids; an unknown, missing or
// repeated field fails the read. Blank lines (whitespace only)
// are skipped; a bad line fails the whole read with its line number, and
// so does a trace without rows or with a line over MaxTraceLineBytes.
// Timestamps must not go backwards: the replays issue requests in trace
// order.
func ReadTrace(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), MaxTraceLineBytes)
	var out []Request
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		q, err := parseRow(b)
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrBadTrace, line, err)
		}
		if n := len(out); n > 0 && q.TimestampMs < out[n-1].TimestampMs {
			return nil, fmt.Errorf("%w: line %d: timestamp %d is before the previous row's %d (sort the trace by timestamp)",
				ErrBadTrace, line, q.TimestampMs, out[n-1].TimestampMs)
		}
		out = append(out, q)
	}
	if err := sc.Err(); errors.Is(err, bufio.ErrTooLong) {
		return nil, fmt.Errorf("%w: line %d: longer than %d MiB, the most a trace line may take", ErrBadTrace, line+1, MaxTraceLineBytes>>20)
	} else if err != nil {
		return nil, fmt.Errorf("read trace: line %d: %w", line+1, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no rows (%d lines, all blank)", ErrBadTrace, line)
	}
	return out, nil
}

// parseRow parses and checks one trace line.
func parseRow(b []byte) (Request, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var row traceRow
	if err := dec.Decode(&row); err != nil {
		return Request{}, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return Request{}, errors.New("more than one JSON object on the line")
	}
	// encoding/json takes "TIMESTAMP" or "hash_id\u017f" (Unicode's case
	// folding) for a field, and a field given twice, the last one winning,
	// which DisallowUnknownFields lets through: a row would replay as
	// something other than what it says. The line is valid JSON now: every
	// key as written.
	if err := strictkeys.Check(b, reflect.TypeFor[traceRow]()); err != nil {
		return Request{}, err
	}
	var missing []string
	for _, f := range []struct {
		name string
		nil  bool
	}{{"timestamp", row.TimestampMs == nil}, {"input_length", row.InputLength == nil},
		{"output_length", row.OutputLength == nil}, {"hash_ids", row.HashIDs == nil}} {
		if f.nil {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return Request{}, fmt.Errorf("missing %s (a row has timestamp, input_length, output_length and hash_ids)", strings.Join(missing, ", "))
	}
	q := Request{TimestampMs: *row.TimestampMs, InputLength: *row.InputLength, OutputLength: *row.OutputLength, HashIDs: *row.HashIDs}
	if q.InputLength <= 0 || q.OutputLength < 0 || q.TimestampMs < 0 ||
		q.InputLength > MaxTraceTokens || q.OutputLength > MaxTraceTokens || q.TimestampMs > MaxTraceTimestampMs {
		return Request{}, fmt.Errorf("input_length %d, output_length %d, timestamp %d (want 1..%d tokens in, 0..%d out, 0..%d ms)",
			q.InputLength, q.OutputLength, q.TimestampMs, MaxTraceTokens, MaxTraceTokens, int64(MaxTraceTimestampMs))
	}
	if want := (q.InputLength + TraceBlockTokens - 1) / TraceBlockTokens; len(q.HashIDs) != want {
		return Request{}, fmt.Errorf("%d hash ids for %d tokens (want ceil(%d/%d) = %d)", len(q.HashIDs), q.InputLength, q.InputLength, TraceBlockTokens, want)
	}
	return q, nil
}

// maxArrivalNs bounds an arrival in simulated nanoseconds: half the
// clock's range, which leaves the other half for the passes that follow the
// last arrival.
const maxArrivalNs = math.MaxInt64 / 2

// arrivalsNs returns each request's arrival in simulated nanoseconds at an
// arrival-speed multiplier: (timestamp − the first timestamp) / speed.
// A replay measures from its first request, so that a trace in epoch
// milliseconds (which ReadTrace accepts) replays as the same trace rebased
// to 0: dividing the absolute timestamps by a speed below 1 would overflow
// the clock. An arrival past maxArrivalNs fails with ErrBadConfig: capping
// it would put every later arrival on one instant and turn the trace into a
// burst without a word. So does a request before the previous one: the
// replays take the requests in trace order (TTFTMs too), and the timed one
// would step its clock back to route it (ReadTrace refuses such a file,
// but a []Request built by hand is not read).
func arrivalsNs(reqs []Request, speed float64) ([]int64, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	base := reqs[0].TimestampMs
	out := make([]int64, len(reqs))
	for k := range reqs {
		if k > 0 && reqs[k].TimestampMs < reqs[k-1].TimestampMs {
			return nil, fmt.Errorf("%w: request %d: timestamp %d is before the previous request's %d (sort the trace by timestamp)",
				ErrBadConfig, k, reqs[k].TimestampMs, reqs[k-1].TimestampMs)
		}
		// In float64: the difference of two arbitrary int64s may wrap,
		// and ReadTrace's timestamps (at most 2^42) are exact in it.
		ms := float64(reqs[k].TimestampMs) - float64(base)
		v := math.Round(ms * 1e6 / speed)
		if !(v <= maxArrivalNs) { // NaN too
			return nil, fmt.Errorf("%w: request %d arrives %.0f ms after the first, %g ns of simulated time at speed %g, past the simulated clock's %d ns (raise the speed)",
				ErrBadConfig, k, ms, v, speed, int64(maxArrivalNs))
		}
		out[k] = int64(v)
	}
	return out, nil
}

// LoadTrace reads a trace file.
func LoadTrace(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open trace: %w", err)
	}
	defer f.Close()
	reqs, err := ReadTrace(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return reqs, nil
}

// Expander turns trace requests into engine blocks: each 512-token id
// becomes 512/BlockSize blocks of synthetic tokens derived from the id, so
// two requests share engine blocks exactly where their ids agree. Only the
// full blocks of the prompt are produced. It reuses its buffers: the
// returned slices are valid until the next call.
type Expander struct {
	BlockSize int
	Seed      uint64 // content-hash seed; 0 means kvevent.Seed

	tokens []uint32
	local  []uint64
	seq    []uint64
}

// Tokens returns the request's prompt tokens (InputLength of them). The
// request must hold ceil(InputLength / 512) hash ids at least (ReadTrace
// and Prepare check it).
func (e *Expander) Tokens(q *Request) []uint32 {
	e.tokens = e.tokens[:0]
	for i := 0; len(e.tokens) < q.InputLength; i++ {
		id := q.HashIDs[i]
		n := min(TraceBlockTokens, q.InputLength-len(e.tokens))
		for j := 0; j < n; j++ {
			// A cheap deterministic token stream per id: SplitMix64 of
			// (id, position), folded into a 17-bit vocabulary.
			e.tokens = append(e.tokens, uint32(splitmix(id*0x9e3779b97f4a7c15+uint64(j))%131072))
		}
	}
	return e.tokens
}

// Blocks returns the content and sequence hashes of the request's full
// blocks.
func (e *Expander) Blocks(q *Request) (local, seq []uint64) {
	seed := e.Seed
	if seed == 0 {
		seed = kvevent.Seed
	}
	e.local = kvevent.LocalHashes(e.local[:0], e.Tokens(q), e.BlockSize, seed)
	e.seq = kvevent.SequenceHashes(e.seq[:0], e.local)
	return e.local, e.seq
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
