package hugepage

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"
)

// vmFlags returns the VmFlags of the mapping holding address p, from
// /proc/self/smaps.
func vmFlags(t *testing.T, p uintptr) []string {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no smaps: %v", err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		var lo, hi uintptr
		// A mapping's first line: "lo-hi perms offset dev inode [name]".
		if first, _, _ := strings.Cut(line, " "); !strings.HasSuffix(first, ":") {
			if n, err := fmt.Sscanf(first, "%x-%x", &lo, &hi); n != 2 || err != nil {
				t.Fatalf("smaps line %q: %v", line, err)
			}
			in = lo <= p && p < hi
			continue
		}
		if in && strings.HasPrefix(line, "VmFlags:") {
			return strings.Fields(strings.TrimPrefix(line, "VmFlags:"))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("reading smaps: %v", err)
	}
	t.Fatalf("no mapping holds %#x", p)
	return nil
}

func has(flags []string, f string) bool {
	for _, x := range flags {
		if x == f {
			return true
		}
	}
	return false
}

// TestAdviceReachesTheKernel: the mapping of an advised array is marked
// for huge pages ("hg"), and after Release it is marked against them
// ("nh"), as the kernel reports it.
func TestAdviceReachesTheKernel(t *testing.T) {
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil {
		t.Skip("kernel without transparent huge pages")
	}
	var sc Scratch
	s := MakeIn[byte](&sc, 3*Size)
	b := span(s)
	p := uintptr(unsafe.Pointer(&b[0]))
	if f := vmFlags(t, p); !has(f, "hg") {
		t.Fatalf("advised mapping's flags %v lack hg", f)
	}
	sc.Release()
	if f := vmFlags(t, p); has(f, "hg") || !has(f, "nh") {
		t.Fatalf("released mapping's flags %v: want nh, not hg", f)
	}
	_ = s[len(s)-1]
}
