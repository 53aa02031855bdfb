package api

import (
	"log/slog"
	"sync"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/promreg"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// Route outcomes, the values of kvrouter_route_requests_total{outcome}.
const (
	outcomeRouted    = "routed"
	outcomeBusy      = "busy"
	outcomeNoWorkers = "no_workers"
	outcomeError     = "error"
)

// Forward outcomes, the values of kvrouter_http_forwards_total{outcome}.
const (
	forwardSent = "sent" // proxied to the leader, its answer relayed whole (whatever it answered)
	// failed: the leader could not be reached, the client went away, or
	// the forward broke before its answer or while relaying it (a stream
	// cut off half-way)
	forwardFailed = "failed"
	forwardLoop   = "loop" // a forwarded request reached a follower again
	forwardNoBody = "no_body"
)

type metrics struct {
	httpRequests  *prometheus.CounterVec   // route, code
	httpDuration  *prometheus.HistogramVec // route
	httpForwards  *prometheus.CounterVec   // route, outcome
	routeRequests *modelSeries             // model, outcome
	routeDuration *prometheus.HistogramVec // stage

	// Is routing winning (metrics.md)? Of the routed requests: their
	// prompt tokens, the chosen rank's cached tokens per tier as the index
	// predicts them, and the best any eligible rank had. With the engines'
	// own cached-token counts these tell "no reuse in the traffic" (best
	// low) from "routing lost it" (predicted below best) from "the index
	// is stale" (the engines' below predicted).
	routePromptTokens prometheus.Counter
	routePredicted    [kvevent.NumTiers]prometheus.Counter
	routeBest         prometheus.Counter

	// eventGaps is kvrouter_events_gaps_total, shared with the event
	// plane's ingester (raftfsm.GapsCounterOpts): the batches of POST
	// /v1/events acknowledged with a gap.
	eventGaps prometheus.Counter

	// routeDuration's series, resolved once: the request's decoding, the
	// backend's stages (raftfsm.RouteStages) and the backend's whole call.
	stageDecode, stageHash, stageMatch, stageLoad, stageScore, stageBook, stageBackend prometheus.Observer

	none, other *modelOutcomes // routeRequests' series of those names
}

// modelSeries is kvrouter_route_requests_total with its series per model,
// resolved on a model's first route: at most maxModelLabels models get
// their own, the rest share other's. It is registered as one collector,
// so that Servers sharing a registry (register) share the cap with the
// family: a cap counted per Server let the family's model label grow by
// maxModelLabels a Server.
type modelSeries struct {
	*prometheus.CounterVec
	mu      sync.Mutex
	models  sync.Map // model name -> *modelOutcomes
	nModels int      // models with their own series (under mu)
}

// maxModelLabels bounds kvrouter_route_requests_total's model label: the
// model is what a client says, so the first this many names get a series
// of their own and later ones count as "other" (metrics.md). A request
// that names none (or whose body does not decode) counts as "none",
// outside the cap; one refused as invalid takes no label (knownModel).
const maxModelLabels = 32

// modelOutcomes are one model's routeRequests series.
type modelOutcomes struct{ routed, busy, noWorkers, error prometheus.Counter }

func (ms *modelSeries) newOutcomes(model string) *modelOutcomes {
	return &modelOutcomes{routed: ms.WithLabelValues(model, outcomeRouted),
		busy:      ms.WithLabelValues(model, outcomeBusy),
		noWorkers: ms.WithLabelValues(model, outcomeNoWorkers),
		error:     ms.WithLabelValues(model, outcomeError)}
}

// forModel returns the series of a valid request's model, giving it one
// while fewer than maxModelLabels models have theirs.
func (m *metrics) forModel(model string) *modelOutcomes {
	switch {
	case model == "":
		return m.none
	case len(model) > maxNameLen || !utf8.ValidString(model):
		return m.other // refused anyway (or not a label value)
	}
	ms := m.routeRequests
	if o, ok := ms.models.Load(model); ok {
		return o.(*modelOutcomes)
	}
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if o, ok := ms.models.Load(model); ok {
		return o.(*modelOutcomes)
	}
	if ms.nModels >= maxModelLabels {
		return m.other
	}
	ms.nModels++
	o := ms.newOutcomes(model)
	ms.models.Store(model, o)
	return o
}

// knownModel returns the series of a refused request's model: its own when
// a valid request already gave it one, other otherwise (none when it names
// none). It never takes a label.
func (m *metrics) knownModel(model string) *modelOutcomes {
	if model == "" {
		return m.none
	}
	if o, ok := m.routeRequests.models.Load(model); ok {
		return o.(*modelOutcomes)
	}
	return m.other
}

// stages observes a route's stage times.
func (m *metrics) stages(st *raftfsm.RouteStages) {
	m.stageHash.Observe(st.Hash.Seconds())
	m.stageMatch.Observe(st.Match.Seconds())
	m.stageLoad.Observe(st.Load.Seconds())
	m.stageScore.Observe(st.Score.Seconds())
	if st.Book > 0 {
		m.stageBook.Observe(st.Book.Seconds())
	}
}

func newMetrics(reg prometheus.Registerer, log *slog.Logger) *metrics {
	m := &metrics{
		httpRequests: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_http_requests_total",
			Help: "HTTP requests answered, by route pattern and status code.",
		}, []string{"route", "code"})),
		httpDuration: register(reg, log, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvrouter_http_request_duration_seconds",
			Help:    "Time to answer an HTTP request, by route pattern (a forwarded request includes the leader's time).",
			Buckets: prometheus.ExponentialBuckets(100e-6, 2, 18), // 100µs .. 13s
		}, []string{"route"})),
		httpForwards: register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_http_forwards_total",
			Help: "Writes that reached a follower, by route pattern and outcome (sent to the leader, failed, loop, no_body).",
		}, []string{"route", "outcome"})),
		routeRequests: register(reg, log, &modelSeries{CounterVec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_route_requests_total",
			Help: "Route requests answered by this node, by the request's model (the first 32 names; later ones as other; none when unnamed) and outcome (routed, busy, no_workers, error).",
		}, []string{"model", "outcome"})}),
		routeDuration: register(reg, log, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvrouter_route_duration_seconds",
			Help:    "Time a route request spent in each stage: decode (the request), hash, match (the index lookup), load, score, book (through Raft), and backend (the whole decision, booking included).",
			Buckets: prometheus.ExponentialBuckets(1e-6, 2, 22), // 1µs .. 2s
		}, []string{"stage"})),
	}
	m.routePromptTokens = register(reg, log, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvrouter_route_prompt_tokens_total",
		Help: "Prompt tokens of the requests this node routed.",
	}))
	predicted := register(reg, log, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrouter_route_predicted_cached_tokens_total",
		Help: "Prompt tokens the index predicted cached on the chosen rank, by tier.",
	}, []string{"tier"}))
	for t := range kvevent.NumTiers {
		m.routePredicted[t] = predicted.WithLabelValues(kvevent.Tier(t).String())
	}
	m.routeBest = register(reg, log, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvrouter_route_best_cached_tokens_total",
		Help: "Prompt tokens the index predicted cached on the best eligible rank (any tier).",
	}))
	m.eventGaps = register(reg, log, prometheus.NewCounter(raftfsm.GapsCounterOpts()))
	m.none, m.other = m.routeRequests.newOutcomes("none"), m.routeRequests.newOutcomes("other")
	stage := func(name string) prometheus.Observer { return m.routeDuration.WithLabelValues(name) }
	m.stageDecode, m.stageHash, m.stageMatch, m.stageLoad = stage("decode"), stage("hash"), stage("match"), stage("load")
	m.stageScore, m.stageBook, m.stageBackend = stage("score"), stage("book"), stage("backend")
	return m
}

// register registers c, or returns the collector already registered under
// its name (promreg.Register), so that several Servers can share one
// registry. A registry that refuses c for another reason is logged and c
// works unregistered.
func register[C prometheus.Collector](reg prometheus.Registerer, log *slog.Logger, c C) C {
	c, err := promreg.Register(reg, c)
	if err != nil {
		log.Warn("metric not registered", "err", err)
	}
	return c
}

// routed counts a routed request's tokens (see metrics.routePromptTokens).
func (m *metrics) routed(d *indexer.Decision, blockSize int) {
	isl := int64(d.Request.ISL)
	m.routePromptTokens.Add(float64(isl))
	bs := int64(blockSize)
	if c := d.Chosen(); c != nil {
		left := isl // the tiers' tokens add up to at most the prompt
		for t, n := range c.Overlap {
			v := min(int64(n)*bs, left)
			left -= v
			m.routePredicted[t].Add(float64(v))
		}
	}
	// Not from d.Candidates: a brief route's hold the chosen one only.
	m.routeBest.Add(float64(min(d.BestOverlapBlocks*bs, isl)))
}
