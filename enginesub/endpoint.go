package enginesub

import (
	"fmt"
	"strconv"
	"strings"
)

// CheckEndpoint refuses, wrapping ErrConfig, a ZMQ endpoint of a shape
// libzmq cannot take for a socket that binds it (bind) or connects to it:
// scheme://address, and for the transports it knows, tcp://host:port,
// ipc://path or inproc://name, the scheme in lower case (libzmq's are). A
// scheme it does not know (ws://, say, which libzmq may be built with) is
// left to libzmq: one it does not support fails Run at its start, not
// each gap. A tcp endpoint needs a host and a port after its last ':' (in libzmq's
// source;host form, those after the last ';'): 1 to 65535 to connect to,
// and not the wildcard host "*"; 0 or "*" (a port the system chooses) and
// host "*" (every interface) only to bind. It checks the shape, not each
// character libzmq takes in a host: some endpoints it lets through libzmq
// still refuses when the socket is opened (Run then fails at its start).
//
// Shape matters because libzmq refuses some of these at once (no scheme,
// no port: "invalid argument") but takes others and then fails to connect
// in the background without a word (no host, port 0 or past 65535): either
// way a subscriber with such an endpoint never hears from the engine.
func CheckEndpoint(ep string, bind bool) error {
	if why := endpointProblem(ep, bind); why != "" {
		return fmt.Errorf("%w: endpoint %q: %s", ErrConfig, ep, why)
	}
	return nil
}

func endpointProblem(ep string, bind bool) string {
	scheme, addr, ok := strings.Cut(ep, "://")
	switch lower := strings.ToLower(scheme); {
	case !ok || scheme == "":
		return "want scheme://address: tcp://host:port, ipc://path or inproc://name"
	case lower != scheme && (lower == "tcp" || lower == "ipc" || lower == "inproc"):
		return fmt.Sprintf("want the scheme in lower case, %s://", lower)
	case scheme == "ipc" || scheme == "inproc":
		if addr == "" {
			return fmt.Sprintf("want %s://%s", scheme, map[string]string{"ipc": "path", "inproc": "name"}[scheme])
		}
		return ""
	case scheme != "tcp":
		// A transport this check does not know (ws, wss, pgm, tipc, ...):
		// libzmq judges it when the socket is opened.
		return ""
	}
	dest := addr[strings.LastIndexByte(addr, ';')+1:]
	i := strings.LastIndexByte(dest, ':')
	if i <= 0 {
		return "want tcp://host:port"
	}
	host, port := dest[:i], dest[i+1:]
	if bind && (port == "*" || port == "0") {
		return "" // a port the system chooses (LocalEndpoint tells which)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		if bind {
			return "want tcp://host:port with a port of 0 to 65535, or *"
		}
		return "want tcp://host:port with a port of 1 to 65535"
	}
	if !bind && host == "*" {
		return "want the engine's address, not the wildcard a bound socket listens on"
	}
	return ""
}
