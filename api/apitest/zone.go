package apitest

import (
	"net"
	"slices"
	"testing"
)

// LoopbackZone returns an IPv6 loopback listener and the name of the
// loopback interface, a zone for its addresses ([::1%lo]); it skips the
// test where the host has neither.
func LoopbackZone(t testing.TB) (net.Listener, string) {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Skip("no interfaces:", err)
	}
	i := slices.IndexFunc(ifs, func(i net.Interface) bool { return i.Flags&net.FlagLoopback != 0 })
	if i < 0 {
		t.Skip("no loopback interface")
	}
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skip("no IPv6 loopback:", err)
	}
	return ln, ifs[i].Name
}
