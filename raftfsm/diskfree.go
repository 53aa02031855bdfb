package raftfsm

import "github.com/kvrouter/kvrouter/internal/diskfree"

// diskFree returns the bytes free to an unprivileged writer on the file
// system that holds dir (see diskfree.Available).
func diskFree(dir string) (uint64, error) { return diskfree.Available(dir) }
