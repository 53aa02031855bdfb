// Package limits holds the bounds every API of the router puts on the ids
// and names clients send (the HTTP API, package api, and the compatible
// API, package compat), so that both refuse the same strings before any
// write: ids travel in URL paths and log lines and key raftfsm's records,
// and names are replicated into the log and every snapshot.
package limits

import (
	"fmt"
	"unicode"
	"unicode/utf8"
)

const (
	MaxIDLen   = 256  // request, reservation, selection, session and member ids
	MaxNameLen = 1024 // models, tenants, endpoints, cache salts, LoRA names
	MaxDPRanks = 4096 // dp ranks of one worker
)

// ID says what is wrong with id, or "" when nothing is: it must be
// non-empty, at most MaxIDLen bytes of valid UTF-8, with no control
// character (C0, DEL or C1). The answer reads after the id's name: "request_id " + ID(id).
func ID(id string) string {
	switch {
	case id == "":
		return "is empty"
	case len(id) > MaxIDLen:
		return fmt.Sprintf("is %d bytes long (at most %d)", len(id), MaxIDLen)
	case !utf8.ValidString(id):
		return "is not valid UTF-8"
	}
	return control(id)
}

// control says that s holds a control character (C0, DEL or C1), or "".
func control(s string) string {
	for _, r := range s {
		if unicode.IsControl(r) { // C0, DEL and C1
			return fmt.Sprintf("%q holds a control character", s)
		}
	}
	return ""
}

// Name says what is wrong with a name, or "" when nothing is: it must be
// at most MaxNameLen bytes.
func Name(s string) string {
	if len(s) > MaxNameLen {
		return fmt.Sprintf("is %d bytes long (at most %d)", len(s), MaxNameLen)
	}
	return ""
}

// PrintableName says what is wrong with a name that is printed in tables
// and log lines, or "" when nothing is: a Name with no control character
// (C0, DEL or C1), which would split a table's row (kvctl workers' model
// column) or a log line.
func PrintableName(s string) string {
	if p := Name(s); p != "" {
		return p
	}
	return control(s)
}

// DPRanks says what is wrong with a worker's dp ranks, or "" when nothing
// is: at most MaxDPRanks of them, none listed twice. A rank listed twice
// would be two route candidates of one rank, of which only the first gets
// the rank's load (raftfsm's route finds a rank's figures by binary
// search): the other would always look idle. The answer is a whole
// phrase: "dp rank 3 is listed twice".
func DPRanks(ranks []uint32) string {
	if len(ranks) > MaxDPRanks {
		return fmt.Sprintf("%d dp ranks (at most %d)", len(ranks), MaxDPRanks)
	}
	seen := make(map[uint32]struct{}, len(ranks))
	for _, dp := range ranks {
		if _, dup := seen[dp]; dup {
			return fmt.Sprintf("dp rank %d is listed twice", dp)
		}
		seen[dp] = struct{}{}
	}
	return ""
}
