// Package rawhttp sends tests' HTTP requests as bytes, for what net/http's
// client will not send: a body that stalls, one cut off before its end, a
// malformed chunked framing. It is for tests only.
package rawhttp

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// Send writes req, an HTTP/1.1 request as bytes, to addr, and then waits
// for the answer, stalling the rest of the body or, when cut, closing its
// side of the connection first; it returns the answer's status and body.
// The answer must come within 10 s.
func Send(t testing.TB, addr, req string, cut bool) (int, []byte) {
	t.Helper()
	code, b, _ := send(t, addr, req, cut, false)
	return code, b
}

// SendThenRead sends req as Send does, its body stalled, and returns, with
// the answer, what a read after the answer gives: io.EOF when the server
// closed the connection within 10 s of it, a timeout error when it still
// held it.
func SendThenRead(t testing.TB, addr, req string) (int, []byte, error) {
	t.Helper()
	return send(t, addr, req, false, true)
}

func send(t testing.TB, addr, req string, cut, readOn bool) (int, []byte, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, req); err != nil {
		t.Fatal(err)
	}
	if cut {
		if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
	}
	if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%d, the answer's body: %v", resp.StatusCode, err)
	}
	if !readOn {
		return resp.StatusCode, b, nil
	}
	_, err = br.ReadByte()
	return resp.StatusCode, b, err
}
