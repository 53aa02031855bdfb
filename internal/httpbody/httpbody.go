// Package httpbody bounds how long a request's body may take to arrive,
// for the HTTP servers that set no ReadTimeout (kvrouter's ports,
// kvagent's engine API socket): one rule for all of them.
package httpbody

import (
	"net/http"
	"time"
)

// Bound gives r's body d to arrive, whether or not a handler reads it:
// net/http reads the unread rest of a body (up to 256 KiB) before it
// writes the answer, so a refusal, a route that takes no body or one that
// fails before its read would otherwise wait, with no deadline, on bytes
// a client declared and never sends, holding the connection for as long
// as it likes. Past the deadline net/http answers and closes the
// connection. The deadline bounds the body's reads only: net/http clears
// it when the body ends and it starts watching the connection. A request
// without a body gets none: net/http is watching the connection already,
// and a deadline there would cancel the connection's context, this
// request's and every later one's on it. A handler that must read longer
// (a snapshot upload) takes it off (SetReadDeadline of the zero time). A
// connection that cannot take one (a test's recorder) reads the body
// without. Call it first in the handler, before anything that may answer.
func Bound(w http.ResponseWriter, r *http.Request, d time.Duration) {
	if rd, ok := w.(readDeadliner); ok && r.Body != http.NoBody && r.ContentLength != 0 { // no allocation, unlike a ResponseController
		_ = rd.SetReadDeadline(time.Now().Add(d))
	}
}

// readDeadliner is a ResponseWriter that can bound its request's reads.
type readDeadliner interface{ SetReadDeadline(time.Time) error }
