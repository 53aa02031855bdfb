// Package lograte keeps a line that repeats from flooding a daemon's log:
// of each kind of line, the first is logged, the others within the
// interval that follows are only counted, and the first one after it is
// logged with how many were left out.
//
// A fault that lasts (a peer down, a port scanned, a client with a wrong
// password) then costs a line per kind per interval, not one per retry or
// per connection, and the line logged still says how often it happened.
// The kinds are the caller's: a constant, or a message with its varying
// parts (addresses, attempt numbers) taken out (Kind). Their number is
// bounded (maxKinds): past it, the kinds not seen for an interval are
// dropped, and if all were seen, new ones share one overflow kind, so
// that an outsider who varies a line cannot grow the limiter. A line of
// the overflow kind that is not logged is not to vanish (it may be the
// first of a fault, its kind crowded out by an outsider's): Check says so,
// for its caller to log it at Debug.
package lograte

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// maxKinds bounds the kinds a Limiter keeps (see the package comment).
const maxKinds = 256

// overflow is the kind the lines of new kinds share once maxKinds are kept.
const overflow = "\x00overflow"

// Limiter decides, per kind of line, whether one is logged now. Its zero
// value is not usable: make one with New. It is safe for concurrent use.
type Limiter struct {
	every time.Duration
	now   func() time.Time

	mu    sync.Mutex
	kinds map[string]*kind
}

type kind struct {
	logged  time.Time // when the last line of the kind was logged
	skipped uint64    // lines of the kind counted, not logged, since
}

// New returns a Limiter that logs a line of each kind at most once per
// every. now is the clock (time.Now when nil).
func New(every time.Duration, now func() time.Time) *Limiter {
	if now == nil {
		now = time.Now
	}
	return &Limiter{every: every, now: now, kinds: make(map[string]*kind)}
}

// Allow reports whether a line of kind k is to be logged now and, when it
// is, how many lines of that kind were left out since the last one logged
// (0 for the first). A line not to be logged is counted.
func (l *Limiter) Allow(k string) (ok bool, skipped uint64) {
	ok, skipped, _ = l.Check(k)
	return ok, skipped
}

// Check is Allow, and also reports whether the line shared the overflow
// kind (maxKinds others were kept, all seen within the interval). A caller
// whose kinds an outsider can vary logs such a line, when it is not to be
// logged, at Debug: under a flood of new kinds, the first line of a fault
// is then still somewhere, at a level that is off by default, rather than
// only counted in a kind that names none of it.
func (l *Limiter) Check(k string) (ok bool, skipped uint64, overflowed bool) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.kinds[k]
	if s == nil {
		if len(l.kinds) >= maxKinds {
			l.forget(now)
		}
		if len(l.kinds) >= maxKinds {
			k, overflowed = overflow, true
			s = l.kinds[k]
		}
		if s == nil {
			l.kinds[k] = &kind{logged: now}
			return true, 0, overflowed
		}
	}
	if now.Sub(s.logged) < l.every {
		s.skipped++
		return false, 0, overflowed
	}
	skipped, s.skipped, s.logged = s.skipped, 0, now
	return true, skipped, overflowed
}

// forget drops the kinds none of whose lines came within the last
// interval and none left out since their last line logged: a line of
// such a kind is logged at once when it comes again, as it would be.
func (l *Limiter) forget(now time.Time) {
	for k, s := range l.kinds {
		if s.skipped == 0 && now.Sub(s.logged) >= l.every {
			delete(l.kinds, k)
		}
	}
}

// LeftOut returns the attributes of a line Allow let through after it
// left out skipped lines of its kind, for a Limiter of interval every:
// none when it left out none, else "left_out" saying how many.
func LeftOut(skipped uint64, every time.Duration) []any {
	if skipped == 0 {
		return nil
	}
	return []any{"left_out", fmt.Sprintf("%d more like it since the last one logged (at most one per %v)", skipped, every)}
}

// Kind returns msg with each run of digits replaced by one '#', for a
// kind of line whose varying parts are numbers: addresses, ports, attempt
// counts, durations ("dial tcp 127.0.0.1:4001 (attempt 9)" and
// "... 127.0.0.1:4002 (attempt 13)" are one kind).
func Kind(msg string) string {
	if strings.IndexFunc(msg, isDigit) < 0 {
		return msg
	}
	b := make([]byte, 0, len(msg))
	for i := 0; i < len(msg); i++ {
		c := msg[i]
		if c < '0' || c > '9' {
			b = append(b, c)
			continue
		}
		if i == 0 || msg[i-1] < '0' || msg[i-1] > '9' {
			b = append(b, '#')
		}
	}
	return string(b)
}

func isDigit(r rune) bool { return r >= '0' && r <= '9' }
