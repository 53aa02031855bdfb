// Package testlog is a log sink for tests: a buffer that a logger (or a
// process's stderr) writes to from any goroutine while the test reads it.
package testlog

import (
	"bytes"
	"strings"
	"sync"
)

// Buffer is an io.Writer safe for concurrent use. Its zero value is empty
// and ready.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Lines returns the lines written so far that hold every one of want.
func (l *Buffer) Lines(want ...string) []string {
	var out []string
	for line := range strings.SplitSeq(l.String(), "\n") {
		ok := line != ""
		for _, w := range want {
			ok = ok && strings.Contains(line, w)
		}
		if ok {
			out = append(out, line)
		}
	}
	return out
}
