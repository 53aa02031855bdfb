package e2e

import "syscall"

// sysProcAttr makes the kernel kill a node when the test process dies, so
// that a crashed or interrupted test run leaves no daemons behind.
//
// Pdeathsig fires when the thread that started the child exits, not the
// process; the Go runtime ends a thread only when a goroutine that locked
// it exits locked, which nothing in this package does.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
