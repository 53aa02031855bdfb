package hugepage

import "syscall"

func advise(b []byte) {
	if len(b) > 0 {
		_ = syscall.Madvise(b, syscall.MADV_HUGEPAGE)
	}
}

func unadvise(b []byte) {
	if len(b) > 0 {
		_ = syscall.Madvise(b, syscall.MADV_NOHUGEPAGE)
	}
}
