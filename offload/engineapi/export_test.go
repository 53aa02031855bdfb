package engineapi

import (
	"net/http"
	"time"
)

// HTTPServer returns the server of s's socket: a test checks its settings.
func (s *Server) HTTPServer() *http.Server { return s.hs }

// SetFreedHook makes every region's shutdown (an unregister, a
// replacement, Close) call f once it has freed the region's G1 blocks and
// before it closes the region's Manager (nil: no call). A test waits for
// it to know that a copy still held is one of freed blocks. Set it before
// the server runs a shutdown, and clear it once none runs.
func SetFreedHook(f func()) { testHookFreed = f }

// SetBodyTimeout sets how long a request's body has to arrive (default
// 30 s) and returns a func that puts the old one back.
func SetBodyTimeout(d time.Duration) (restore func()) {
	old := bodyTimeout
	bodyTimeout = d
	return func() { bodyTimeout = old }
}
