package benchcluster

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes the kernel SIGKILL the child when the test process
// dies (a panic or a -timeout), so no node outlives a failed run.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
