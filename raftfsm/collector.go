package raftfsm

import (
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// The garbage collector is held off while a state loads, and on a node's
// start until the node is ready.
//
// A load grows the heap from nothing to the index's size, and nearly all
// of it stays live (the loader's record chunks never move): a collection
// during the load would find little to free and trace everything built so
// far. On the 5M-block restart benchmark, collections at GOGC=800 cost
// about 0.6 s of the restart.
//
// The first collection after a load traces the whole heap too, and it
// starts at once: the collector's goal is relative to the heap it marked
// last, before the load. On a node's start it ran beside the replay of the
// log tail and took that replay over: of its 0.62 s of CPU on the 5M
// restart benchmark, 0.49 s was spent assisting the collector. So a start
// keeps the collector off until the node is ready (FSM.holdAfterLoad),
// bounded: the heap may grow by half of what the runtime held at the
// load's end (at least afterLoadSlack) before the runtime collects anyway,
// through a memory limit. A lower GOMEMLIMIT stays in force throughout.
//
// Holds nest (three in-process nodes load at once in tests): the first
// takes the settings, the last release puts them back.
var collector struct {
	mu      sync.Mutex
	holds   int
	percent int   // GOGC before the first hold
	limit   int64 // the memory limit before the first hold
}

// afterLoadSlack is the least growth holdCollectorAfterLoad allows.
const afterLoadSlack = 256 << 20

// holdCollector turns the collector off until release (which may be
// called more than once) and every other hold's release.
func holdCollector() (release func()) {
	collector.mu.Lock()
	defer collector.mu.Unlock()
	if collector.holds == 0 {
		collector.percent = debug.SetGCPercent(-1)
		collector.limit = debug.SetMemoryLimit(-1) // reads it
	}
	collector.holds++
	var once sync.Once
	return func() {
		once.Do(func() {
			collector.mu.Lock()
			defer collector.mu.Unlock()
			collector.holds--
			if collector.holds == 0 {
				debug.SetMemoryLimit(collector.limit)
				debug.SetGCPercent(collector.percent)
			}
		})
	}
}

// holdCollectorAfterLoad is holdCollector with the heap's growth bounded
// by a memory limit: half of what the runtime holds now, at least
// afterLoadSlack.
func holdCollectorAfterLoad() (release func()) {
	release = holdCollector()
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return release
	}
	total := int64(s[0].Value.Uint64())
	limit := total + max(total/2, afterLoadSlack)
	collector.mu.Lock()
	if limit < debug.SetMemoryLimit(-1) {
		debug.SetMemoryLimit(limit)
	}
	collector.mu.Unlock()
	return release
}
