package listenaddr

import "testing"

// TestListenAddressesClashAsTheKernelSaysTheyDo: two listen addresses
// clash on the same port (as a number), other than 0, on the same host or
// where one is a wildcard that covers the other.
func TestListenAddressesClashAsTheKernelSaysTheyDo(t *testing.T) {
	for _, c := range []struct {
		a, b  string
		clash bool
	}{
		{"127.0.0.1:7000", "127.0.0.1:7000", true},
		{"127.0.0.1:7000", "127.0.0.1:07000", true},
		{"0.0.0.0:7000", "127.0.0.1:7000", true},
		{"127.0.0.1:7000", ":7000", true},
		{"[::]:7000", "10.0.0.1:7000", true},
		{"0.0.0.0:7000", "node1:7000", true},
		{"[::ffff:127.0.0.1]:7000", "127.0.0.1:7000", true},
		{"Node1.:7000", "node1:7000", true},
		{"[::1]:7000", "[0::1]:7000", true},
		{"127.0.0.1:0", "127.0.0.1:0", false},
		{":0", "0.0.0.0:0", false},
		{"127.0.0.1:7000", "127.0.0.1:7001", false},
		{"127.0.0.1:7000", "127.0.0.2:7000", false},
		{"0.0.0.0:7000", "[::1]:7000", false},
		{"localhost:7000", "127.0.0.1:7000", false},
		{"127.0.0.1", "127.0.0.1", false},
	} {
		if got := Same(c.a, c.b); got != c.clash {
			t.Errorf("Same(%q, %q) = %v, want %v", c.a, c.b, got, c.clash)
		}
	}
}
