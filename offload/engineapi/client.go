package engineapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
)

// Client calls a Server over its Unix socket: for tests, and for engines
// written in Go. It is safe for concurrent use; Close releases its idle
// connections.
type Client struct {
	hc *http.Client
	tr *http.Transport
}

// NewClient returns a client of the server listening on socket.
func NewClient(socket string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		MaxIdleConnsPerHost: 16,
	}
	return &Client{hc: &http.Client{Transport: tr}, tr: tr}
}

// Close closes the client's idle connections.
func (c *Client) Close() { c.tr.CloseIdleConnections() }

// Register registers (or replaces) a rank's G1 region.
func (c *Client) Register(ctx context.Context, q RegisterRequest) (RegisterResponse, error) {
	var r RegisterResponse
	return r, c.do(ctx, http.MethodPost, PathRegion, q, &r)
}

// Unregister drops a rank's G1 region.
func (c *Client) Unregister(ctx context.Context, dp uint32) (UnregisterResponse, error) {
	var r UnregisterResponse
	return r, c.do(ctx, http.MethodPost, PathUnregister, UnregisterRequest{DPRank: dp}, &r)
}

// Offload queues G1 blocks for the write-through to G2 (or G3).
func (c *Client) Offload(ctx context.Context, q OffloadRequest) (OffloadResponse, error) {
	var r OffloadResponse
	return r, c.do(ctx, http.MethodPost, PathOffload, q, &r)
}

// Free tells the agent that G1 blocks were freed; call it before writing
// into a block that was offloaded.
func (c *Client) Free(ctx context.Context, q FreeRequest) (FreeResponse, error) {
	var r FreeResponse
	return r, c.do(ctx, http.MethodPost, PathFree, q, &r)
}

// Lookup asks which tiers hold blocks.
func (c *Client) Lookup(ctx context.Context, q LookupRequest) (LookupResponse, error) {
	var r LookupResponse
	return r, c.do(ctx, http.MethodPost, PathLookup, q, &r)
}

// Onboard copies blocks back into G1 and returns when they are there (or
// what became of each).
func (c *Client) Onboard(ctx context.Context, q OnboardRequest) (OnboardResponse, error) {
	var r OnboardResponse
	return r, c.do(ctx, http.MethodPost, PathOnboard, q, &r)
}

// Stats returns every rank's counters.
func (c *Client) Stats(ctx context.Context) (StatsResponse, error) {
	var r StatsResponse
	return r, c.do(ctx, http.MethodGet, PathStats, nil, &r)
}

// Health returns nil when the server answers.
func (c *Client) Health(ctx context.Context) error {
	var r map[string]string
	return c.do(ctx, http.MethodGet, PathHealth, nil, &r)
}

// Raw sends body as is and returns the status and the answer's body (tests
// of malformed requests).
func (c *Client) Raw(ctx context.Context, method, path string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, "http://kvagent"+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// do sends q (nil: no body) and decodes a 200 answer into out, or an error
// answer into an *Error.
func (c *Client) do(ctx context.Context, method, path string, q, out any) error {
	var body []byte
	if q != nil {
		var err error
		if body, err = json.Marshal(q); err != nil {
			return fmt.Errorf("%s %s: %w", method, path, err)
		}
	}
	status, b, err := c.Raw(ctx, method, path, body)
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, path, err)
	}
	if status != http.StatusOK {
		e := &Error{Status: status}
		if json.Unmarshal(b, e) != nil || e.Code == "" {
			e.Code, e.Message = codeInternal, string(bytes.TrimSpace(b))
		}
		return fmt.Errorf("%s %s: %w", method, path, e)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: decoding the answer: %w", method, path, err)
	}
	return nil
}
