package engineapi

import "net/http"

// HTTPServer returns the server of s's socket: a test checks its settings.
func (s *Server) HTTPServer() *http.Server { return s.hs }

// SetFreedHook makes every region's shutdown (an unregister, a
// replacement, Close) call f once it has freed the region's G1 blocks and
// before it closes the region's Manager (nil: no call). A test waits for
// it to know that a copy still held is one of freed blocks. Set it before
// the server runs a shutdown, and clear it once none runs.
func SetFreedHook(f func()) { testHookFreed = f }
