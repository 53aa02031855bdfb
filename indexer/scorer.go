// scorer.go chooses the rank a request goes to (semantics.md §5): it costs
// every candidate rank from its cache overlap and its load, skips busy ranks,
// and takes the cheapest (temperature 0) or samples a softmax over the
// range-normalised costs (temperature > 0).
//
// The cost of a rank, smaller is better:
//
//	credit   = overlap_score_credit*device + host_cache_hit_weight*host
//	         + disk_cache_hit_weight*(disk + external)
//	prefill  = max((active_prefill_tokens + isl)/block_size - credit, 0)
//	cost     = prefill_load_scale*prefill + potential_decode_blocks
//	         + decode_active_request_weight*active_requests
//
// Invariants:
//   - Select is a pure function of its arguments and the rng's draws: the
//     same inputs give the same Decision. At temperature 0 it draws nothing,
//     and ties go, in order, to the longer total overlap, the fewer active
//     decode blocks, then the highest rendezvous hash of (first block hash,
//     rank), so that requests sharing a prefix keep landing on one rank. Only
//     candidates that agree on all of that (the same rank given twice) fall
//     back to input order. At temperature > 0 it draws exactly one Float64.
//   - A busy rank is never chosen. A worker is busy only when all its ranks
//     are; as its busy ranks are skipped, it still takes requests through its
//     others. When every candidate is busy the answer is ErrOverloaded with
//     the thresholds that tripped, never a silent pick.
//   - Bad input (a non-positive block size, a negative length, load or
//     parameter, a NaN) is an error, never a panic and never a guess.
//   - A Decision is reusable: Select resets it and, once its slice has grown
//     to the number of candidates, allocates nothing.

package indexer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Params are the scoring weights and busy thresholds of a cluster
// (semantics.md §5). The weights may be overridden per request (Overrides);
// the busy thresholds may not, so that no client can opt out of overload
// protection.
type Params struct {
	OverlapScoreCredit        float64 `json:"overlap_score_credit"`
	HostCacheHitWeight        float64 `json:"host_cache_hit_weight"`
	DiskCacheHitWeight        float64 `json:"disk_cache_hit_weight"` // disk and external tiers
	PrefillLoadScale          float64 `json:"prefill_load_scale"`
	DecodeActiveRequestWeight float64 `json:"decode_active_request_weight"`
	Temperature               float64 `json:"temperature"`

	// BusyDecodeFraction marks a rank busy when its active decode blocks
	// exceed this fraction of its capacity in blocks. 0 turns it off; it
	// does not apply to a rank of unknown (zero) capacity.
	BusyDecodeFraction float64 `json:"busy_decode_fraction"`
	// BusyPrefillTokens marks a rank busy when its active prefill tokens
	// exceed it. 0 turns it off.
	BusyPrefillTokens int64 `json:"busy_prefill_tokens"`
}

// DefaultParams returns the defaults of semantics.md §5, with no busy
// threshold.
func DefaultParams() Params {
	return Params{
		OverlapScoreCredit: 1.0,
		HostCacheHitWeight: 0.75,
		DiskCacheHitWeight: 0.25,
		PrefillLoadScale:   1.0,
	}
}

// MaxWeight bounds every weight (and the temperature and busy fraction)
// that Validate takes: far above any useful value, and low enough that no
// cost can overflow (a weight of 1e308 made every route's cost +Inf, and
// one cluster setting so broke every route). Select does not hold stored
// settings to it: a cluster may hold larger weights that an older version
// took, with which costs stay finite.
const MaxWeight = 1e12

// Validate checks that every weight is finite, not negative and at most
// MaxWeight: the check of new settings and of a request's overrides.
func (p Params) Validate() error { return p.validate(MaxWeight) }

// ValidateKeeping is Validate, except that a field over MaxWeight passes
// when it equals held's, the value the cluster holds now for it: a weight
// an older build stored, put back as it is (GET /v1/settings' answer put
// back sets the same settings). A new value over MaxWeight is refused as
// Validate refuses it.
func (p Params) ValidateKeeping(held Params) error {
	q := p
	for _, f := range [...]struct {
		v    *float64
		held float64
	}{
		{&q.OverlapScoreCredit, held.OverlapScoreCredit},
		{&q.HostCacheHitWeight, held.HostCacheHitWeight},
		{&q.DiskCacheHitWeight, held.DiskCacheHitWeight},
		{&q.PrefillLoadScale, held.PrefillLoadScale},
		{&q.DecodeActiveRequestWeight, held.DecodeActiveRequestWeight},
		{&q.Temperature, held.Temperature},
		{&q.BusyDecodeFraction, held.BusyDecodeFraction},
	} {
		if *f.v > MaxWeight && *f.v == f.held && !math.IsInf(f.held, 1) {
			*f.v = MaxWeight // kept as the cluster holds it; checked as in bounds
		}
	}
	return q.Validate()
}

// ValidateStored checks what Select holds settings to: every weight
// finite and not negative, with no upper bound (a cluster may hold larger
// weights that an older version took). The check of settings a state
// holds: a snapshot's or a committed entry's.
func (p Params) ValidateStored() error { return p.validate(math.Inf(1)) }

// validate is Validate with max as the bound; Select's is +Inf.
func (p Params) validate(max float64) error {
	for _, f := range [...]struct {
		name string
		v    float64
	}{
		{"overlap_score_credit", p.OverlapScoreCredit},
		{"host_cache_hit_weight", p.HostCacheHitWeight},
		{"disk_cache_hit_weight", p.DiskCacheHitWeight},
		{"prefill_load_scale", p.PrefillLoadScale},
		{"decode_active_request_weight", p.DecodeActiveRequestWeight},
		{"temperature", p.Temperature},
		{"busy_decode_fraction", p.BusyDecodeFraction},
	} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 || f.v > max {
			if math.IsInf(max, 1) {
				return fmt.Errorf("%w: %s = %v (want a finite value >= 0)", ErrInvalidParams, f.name, f.v)
			}
			return fmt.Errorf("%w: %s = %v (want 0 to %g)", ErrInvalidParams, f.name, f.v, max)
		}
	}
	if p.BusyPrefillTokens < 0 {
		return fmt.Errorf("%w: busy_prefill_tokens = %d (want >= 0)", ErrInvalidParams, p.BusyPrefillTokens)
	}
	return nil
}

// Overrides are a request's own scoring weights; a nil field keeps the
// cluster's value.
type Overrides struct {
	OverlapScoreCredit        *float64 `json:"overlap_score_credit,omitempty"`
	HostCacheHitWeight        *float64 `json:"host_cache_hit_weight,omitempty"`
	DiskCacheHitWeight        *float64 `json:"disk_cache_hit_weight,omitempty"`
	PrefillLoadScale          *float64 `json:"prefill_load_scale,omitempty"`
	DecodeActiveRequestWeight *float64 `json:"decode_active_request_weight,omitempty"`
	Temperature               *float64 `json:"temperature,omitempty"`
}

// With returns p with o's set fields in place of its own. o may be nil. The
// result is not validated: Select does that.
func (p Params) With(o *Overrides) Params {
	if o == nil {
		return p
	}
	set := func(dst *float64, v *float64) {
		if v != nil {
			*dst = *v
		}
	}
	set(&p.OverlapScoreCredit, o.OverlapScoreCredit)
	set(&p.HostCacheHitWeight, o.HostCacheHitWeight)
	set(&p.DiskCacheHitWeight, o.DiskCacheHitWeight)
	set(&p.PrefillLoadScale, o.PrefillLoadScale)
	set(&p.DecodeActiveRequestWeight, o.DecodeActiveRequestWeight)
	set(&p.Temperature, o.Temperature)
	return p
}

// Request is what the scorer needs to know of a route request.
type Request struct {
	ISL            int    // input length in tokens
	BlockSize      int    // tokens per block of the model
	FirstBlockHash uint64 // the request's first block hash; keys rendezvous tie-breaks
}

// Candidate is one rank that could take the request: its cache overlap per
// tier (from the index) and its load (from Sequences).
type Candidate struct {
	Rank                  kvevent.Rank
	Overlap               [kvevent.NumTiers]uint32 // matched blocks per tier
	Load                  Load
	PotentialDecodeBlocks int64 // active decode blocks + request blocks the rank does not hold
	CapacityBlocks        int64 // the rank's KV capacity in blocks; 0 when unknown
}

// BusyReason says which busy thresholds a rank is over; zero when none.
type BusyReason uint8

// Busy reasons; a rank may be over both.
const (
	BusyDecodeBlocks  BusyReason = 1 << iota // active decode blocks over busy_decode_fraction of capacity
	BusyPrefillTokens                        // active prefill tokens over busy_prefill_tokens
)

// String returns a metric-label form: "decode_blocks", "prefill_tokens",
// "decode_blocks+prefill_tokens", or "" when not busy.
func (r BusyReason) String() string {
	switch r {
	case 0:
		return ""
	case BusyDecodeBlocks:
		return "decode_blocks"
	case BusyPrefillTokens:
		return "prefill_tokens"
	case BusyDecodeBlocks | BusyPrefillTokens:
		return "decode_blocks+prefill_tokens"
	}
	return fmt.Sprintf("busy(%d)", uint8(r))
}

// DecidedBy says which rule picked the chosen rank over the others.
type DecidedBy uint8

// The rules, in the order of the temperature-0 tie chain, then sampling.
const (
	DecidedByCost         DecidedBy = iota // the only eligible rank, or strictly the cheapest
	DecidedByOverlap                       // tied on cost; the longest total overlap
	DecidedByActiveBlocks                  // tied on cost and overlap; the fewest active decode blocks
	DecidedByRendezvous                    // tied on all; the highest rendezvous hash
	DecidedByInputOrder                    // the same rank given twice; the first
	DecidedBySample                        // sampled from the softmax (temperature > 0)
	// DecidedBySession: tied on cost, the rank a session used last (set by
	// the caller of Select, which knows sessions; see Decision.Prefer).
	DecidedBySession
	// DecidedByBooking: the request was already booked on this rank (a
	// retried route that books; set by the caller, see Decision.Keep).
	DecidedByBooking
)

var decidedByNames = [...]string{"cost", "overlap", "active_blocks", "rendezvous", "input_order", "sample", "session", "booking"}

func (d DecidedBy) String() string {
	if int(d) < len(decidedByNames) {
		return decidedByNames[d]
	}
	return fmt.Sprintf("decided_by(%d)", uint8(d))
}

// CandidateScore is one candidate's cost and every term of it.
type CandidateScore struct {
	Rank                  kvevent.Rank
	Overlap               [kvevent.NumTiers]uint32 // matched blocks per tier
	OverlapBlocks         int64                    // their sum
	Credit                float64                  // blocks of prefill the cache saves
	RawPrefillBlocks      float64                  // (active_prefill_tokens + isl) / block_size
	PrefillBlocks         float64                  // max(raw - credit, 0)
	PotentialDecodeBlocks int64
	ActivePrefillTokens   int64
	ActiveDecodeBlocks    int64
	ActiveRequests        int64
	CapacityBlocks        int64
	Cost                  float64
	Busy                  bool
	BusyReason            BusyReason
	Probability           float64 // of being sampled (temperature > 0); 0 when busy
	Rendezvous            uint64  // the tie-break hash of (first block hash, rank)
}

// Decision is the outcome of Select and why: the chosen rank and, per
// candidate in input order, every term of its cost. Reuse one across calls
// of one goroutine (Select itself is safe to call concurrently with
// different Decisions and rngs).
type Decision struct {
	Rank          kvevent.Rank
	Index         int // of the chosen candidate; -1 when none was chosen
	Cost          float64
	DecidedBy     DecidedBy
	RequestBlocks int64 // ceil(isl / block_size)
	BusyRanks     int
	Params        Params // the effective parameters (cluster merged with overrides)
	Request       Request
	Candidates    []CandidateScore

	// BestOverlapBlocks is the longest OverlapBlocks of an eligible (not
	// busy) candidate, to set against the chosen one's. It stands when
	// Candidates are cut down (a brief route's hold the chosen one only);
	// Prefer and Keep leave it as it is.
	BestOverlapBlocks int64
}

// Prefer moves the choice to rank r when r is an eligible candidate whose
// cost equals the chosen one's, so that a session stays where its cache
// is when nothing separates the two on cost; the tie chain after cost
// (overlap, active blocks, rendezvous) gives way to it. A sampled decision
// (temperature > 0) is left as it is. It reports whether the choice moved.
func (d *Decision) Prefer(r kvevent.Rank) bool {
	c := d.Chosen()
	if c == nil || d.DecidedBy == DecidedBySample || c.Rank == r {
		return false
	}
	for i := range d.Candidates {
		p := &d.Candidates[i]
		if p.Rank == r && !p.Busy && p.Cost == c.Cost {
			d.Rank, d.Index, d.DecidedBy = r, i, DecidedBySession
			return true
		}
	}
	return false
}

// Keep moves the choice to rank r, whatever its cost, when r is a
// candidate: the request is already booked there (DecidedByBooking), and
// a second booking elsewhere would count its load twice. The decision's
// cost becomes r's. It reports whether r is a candidate.
func (d *Decision) Keep(r kvevent.Rank) bool {
	if c := d.Chosen(); c != nil && c.Rank == r {
		return true
	}
	for i := range d.Candidates {
		if d.Candidates[i].Rank == r {
			d.Rank, d.Index, d.DecidedBy, d.Cost = r, i, DecidedByBooking, d.Candidates[i].Cost
			return true
		}
	}
	return false
}

// Chosen returns the chosen candidate's score, or nil when none was chosen.
func (d *Decision) Chosen() *CandidateScore {
	if d.Index < 0 || d.Index >= len(d.Candidates) {
		return nil
	}
	return &d.Candidates[d.Index]
}

func (d *Decision) reset(p Params, req Request) {
	*d = Decision{Index: -1, Params: p, Request: req, Candidates: d.Candidates[:0]}
}

// Select chooses the rank for req among cands under p and fills d (which it
// resets first). rng is drawn from only when p.Temperature > 0 and may be nil
// otherwise.
//
// Errors: ErrInvalidParams, ErrInvalidRequest or ErrInvalidCandidate for bad
// input; ErrNoWorkers when cands is empty; ErrOverloaded when every candidate
// is busy. On ErrOverloaded d still holds every candidate's score and busy
// reason, for the operator.
func Select(p Params, req Request, cands []Candidate, rng *rand.Rand, d *Decision) error {
	d.reset(p, req)
	if err := p.ValidateStored(); err != nil {
		return fmt.Errorf("select: %w", err)
	}
	if p.Temperature > 0 && rng == nil {
		return fmt.Errorf("select: %w: temperature %v needs a random source", ErrInvalidParams, p.Temperature)
	}
	if req.BlockSize <= 0 {
		return fmt.Errorf("select: %w: block size %d (want > 0)", ErrInvalidRequest, req.BlockSize)
	}
	if req.ISL < 0 {
		return fmt.Errorf("select: %w: input length %d (want >= 0)", ErrInvalidRequest, req.ISL)
	}
	d.RequestBlocks = int64(req.ISL / req.BlockSize)
	if req.ISL%req.BlockSize != 0 {
		d.RequestBlocks++
	}
	if len(cands) == 0 {
		return fmt.Errorf("select: %w", ErrNoWorkers)
	}

	best := -1
	var busyDecode, busyPrefill int
	for i := range cands {
		c := &cands[i]
		if err := validateCandidate(c); err != nil {
			return fmt.Errorf("select: %w", err)
		}
		// Scored in place: a CandidateScore is large enough that building
		// it and copying it in costs more than the arithmetic.
		d.Candidates = append(d.Candidates, CandidateScore{})
		s := &d.Candidates[i]
		scoreCandidate(s, &p, &req, c)
		if math.IsInf(s.Cost, 0) || math.IsNaN(s.Cost) {
			return fmt.Errorf("select: %w: rank %v: cost overflows (%v)", ErrInvalidCandidate, c.Rank, s.Cost)
		}
		if s.Busy {
			d.BusyRanks++
			if s.BusyReason&BusyDecodeBlocks != 0 {
				busyDecode++
			}
			if s.BusyReason&BusyPrefillTokens != 0 {
				busyPrefill++
			}
			continue
		}
		d.BestOverlapBlocks = max(d.BestOverlapBlocks, s.OverlapBlocks)
		if best < 0 || better(s, &d.Candidates[best]) {
			best = i
		}
	}
	if best < 0 {
		return overloaded(&p, len(cands), busyDecode, busyPrefill)
	}

	if p.Temperature > 0 {
		best = d.sample(p.Temperature, rng)
		d.DecidedBy = DecidedBySample
	} else {
		d.DecidedBy = decidedBy(d.Candidates, best)
	}
	d.Index = best
	d.Rank = d.Candidates[best].Rank
	d.Cost = d.Candidates[best].Cost
	return nil
}

func validateCandidate(c *Candidate) error {
	switch {
	case c.Load.ActivePrefillTokens < 0, c.Load.ActiveDecodeBlocks < 0, c.Load.ActiveRequests < 0:
		return fmt.Errorf("%w: rank %v: negative load %+v", ErrInvalidCandidate, c.Rank, c.Load)
	case c.PotentialDecodeBlocks < 0:
		return fmt.Errorf("%w: rank %v: negative potential decode blocks %d", ErrInvalidCandidate, c.Rank, c.PotentialDecodeBlocks)
	case c.CapacityBlocks < 0:
		return fmt.Errorf("%w: rank %v: negative capacity %d", ErrInvalidCandidate, c.Rank, c.CapacityBlocks)
	}
	return nil
}

// scoreCandidate computes every term of the §5 cost and the busy flags into
// s, which must be zero.
func scoreCandidate(s *CandidateScore, p *Params, req *Request, c *Candidate) {
	s.Rank = c.Rank
	s.Overlap = c.Overlap
	s.PotentialDecodeBlocks = c.PotentialDecodeBlocks
	s.ActivePrefillTokens = c.Load.ActivePrefillTokens
	s.ActiveDecodeBlocks = c.Load.ActiveDecodeBlocks
	s.ActiveRequests = c.Load.ActiveRequests
	s.CapacityBlocks = c.CapacityBlocks
	s.Rendezvous = rendezvous(req.FirstBlockHash, c.Rank)
	for _, n := range c.Overlap {
		s.OverlapBlocks += int64(n)
	}
	dev := float64(c.Overlap[kvevent.TierDevice])
	host := float64(c.Overlap[kvevent.TierHostPinned])
	low := float64(c.Overlap[kvevent.TierDisk]) + float64(c.Overlap[kvevent.TierExternal])
	// Explicit float64 conversions keep the compiler from fusing a
	// multiply-add, so the cost is bit-identical on every architecture.
	s.Credit = float64(p.OverlapScoreCredit*dev) + float64(p.HostCacheHitWeight*host) + float64(p.DiskCacheHitWeight*low)
	s.RawPrefillBlocks = (float64(c.Load.ActivePrefillTokens) + float64(req.ISL)) / float64(req.BlockSize)
	s.PrefillBlocks = max(s.RawPrefillBlocks-s.Credit, 0)
	s.Cost = float64(p.PrefillLoadScale*s.PrefillBlocks) + float64(c.PotentialDecodeBlocks) +
		float64(p.DecodeActiveRequestWeight*float64(c.Load.ActiveRequests))

	s.BusyReason = p.BusyOf(c.Load, c.CapacityBlocks)
	s.Busy = s.BusyReason != 0
}

// BusyOf says which busy thresholds a rank with load l and a KV capacity
// of capacityBlocks (0: unknown) is over.
func (p *Params) BusyOf(l Load, capacityBlocks int64) BusyReason {
	var r BusyReason
	if p.BusyDecodeFraction > 0 && capacityBlocks > 0 &&
		float64(l.ActiveDecodeBlocks) > float64(p.BusyDecodeFraction*float64(capacityBlocks)) {
		r |= BusyDecodeBlocks
	}
	if p.BusyPrefillTokens > 0 && l.ActivePrefillTokens > p.BusyPrefillTokens {
		r |= BusyPrefillTokens
	}
	return r
}

// better reports whether a goes before b in the temperature-0 order: lower
// cost, then longer total overlap, then fewer active decode blocks, then a
// higher rendezvous hash. Costs compare exactly: equal inputs give
// bit-identical costs, which is what a tie is.
func better(a, b *CandidateScore) bool {
	if a.Cost != b.Cost {
		return a.Cost < b.Cost
	}
	if a.OverlapBlocks != b.OverlapBlocks {
		return a.OverlapBlocks > b.OverlapBlocks
	}
	if a.ActiveDecodeBlocks != b.ActiveDecodeBlocks {
		return a.ActiveDecodeBlocks < b.ActiveDecodeBlocks
	}
	return a.Rendezvous > b.Rendezvous
}

// decidedBy returns the deepest rule of the tie chain needed to set the
// chosen candidate apart from every other eligible one.
func decidedBy(scores []CandidateScore, best int) DecidedBy {
	b := &scores[best]
	by := DecidedByCost
	for i := range scores {
		o := &scores[i]
		if i == best || o.Busy {
			continue
		}
		var level DecidedBy
		switch {
		case o.Cost != b.Cost:
			level = DecidedByCost
		case o.OverlapBlocks != b.OverlapBlocks:
			level = DecidedByOverlap
		case o.ActiveDecodeBlocks != b.ActiveDecodeBlocks:
			level = DecidedByActiveBlocks
		case o.Rendezvous != b.Rendezvous:
			level = DecidedByRendezvous
		default:
			level = DecidedByInputOrder
		}
		by = max(by, level)
	}
	return by
}

// sample draws one eligible candidate from the softmax over range-normalised
// costs, p ∝ exp(-(c - c_min) / ((c_max - c_min) * T)), uniform when every
// eligible cost is equal, records each one's probability and returns the
// index drawn. It draws exactly one Float64 from rng.
func (d *Decision) sample(temp float64, rng *rand.Rand) int {
	cs := d.Candidates
	cmin, cmax := math.Inf(1), math.Inf(-1)
	for i := range cs {
		if !cs[i].Busy {
			cmin, cmax = min(cmin, cs[i].Cost), max(cmax, cs[i].Cost)
		}
	}
	// Range normalisation makes the temperature scale-free: T = 1 means the
	// most expensive rank is e times less likely than the cheapest.
	// A scale that underflows to 0 leaves only the cheapest ranks with
	// weight; it never divides 0 by 0 because the cheapest weigh 1 directly.
	scale := (cmax - cmin) * temp
	var sum float64
	for i := range cs {
		s := &cs[i]
		switch {
		case s.Busy:
			s.Probability = 0
		case s.Cost == cmin:
			s.Probability = 1
		default:
			s.Probability = math.Exp(-(s.Cost - cmin) / scale)
		}
		sum += s.Probability
	}
	u := rng.Float64() * sum
	chosen, last := -1, -1
	var acc float64
	for i := range cs {
		s := &cs[i]
		if s.Busy {
			continue
		}
		if s.Probability > 0 {
			last = i
		}
		acc += s.Probability
		if chosen < 0 && u < acc {
			chosen = i
		}
		s.Probability /= sum
	}
	if chosen < 0 { // u landed on the rounding edge of the last bucket
		chosen = last
	}
	return chosen
}

func overloaded(p *Params, n, busyDecode, busyPrefill int) error {
	var why []string
	if busyDecode > 0 {
		why = append(why, fmt.Sprintf("%d over %g of their decode block capacity", busyDecode, p.BusyDecodeFraction))
	}
	if busyPrefill > 0 {
		why = append(why, fmt.Sprintf("%d over %d active prefill tokens", busyPrefill, p.BusyPrefillTokens))
	}
	return fmt.Errorf("select: %w: all %d ranks busy: %s", ErrOverloaded, n, strings.Join(why, ", "))
}

// rendezvous is the tie-break hash of (first block hash, rank): highest
// wins. Chained SplitMix64 finalisers make every input bit change every
// output bit, so ranks win ties in an order that is random across prefixes
// but fixed for one prefix. The values are pinned in scorer_test.go: a
// change reroutes every tied prefix.
func rendezvous(firstBlockHash uint64, r kvevent.Rank) uint64 {
	h := mix64(firstBlockHash ^ 0x9e3779b97f4a7c15)
	h = mix64(h ^ r.Worker)
	return mix64(h ^ (uint64(r.DP) | 0xd6e8feb800000000))
}
