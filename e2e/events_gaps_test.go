package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"
)

// TestAGapAcknowledgedOverHTTPIsCounted: kvrouter_events_gaps_total is
// "rank batches acknowledged with a gap" (docs/operations.md, What to
// watch; its help). A batch POSTed to /v1/events that starts above the
// rank's cursor is acknowledged with gap: true, and must be counted there,
// as the same batch over the NATS event plane is.
func TestAGapAcknowledgedOverHTTPIsCounted(t *testing.T) {
	c := startCluster(t, 1)
	url := "http://" + c.nodes[c.leader()].httpAddr
	post := func(body string) []byte {
		t.Helper()
		resp, err := http.Post(url+"/v1/events", "application/json", bytes.NewBufferString(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		if _, err := b.ReadFrom(resp.Body); err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("POST /v1/events: %s %s", resp.Status, b.String())
		}
		return b.Bytes()
	}
	post(`{"batches": [{"worker_id": 1, "events": [{"event_id": 1, "type": "stored", "tier": "device", "blocks": [{"hash": 11, "local_hash": 101}]}]}]}`)
	out := post(`{"batches": [{"worker_id": 1, "events": [{"event_id": 5, "type": "stored", "tier": "device", "blocks": [{"hash": 12, "local_hash": 102}]}]}]}`)
	var acks struct {
		Acks []struct {
			Gap bool `json:"gap"`
		} `json:"acks"`
	}
	if err := json.Unmarshal(out, &acks); err != nil || len(acks.Acks) != 1 || !acks.Acks[0].Gap {
		t.Fatalf("the gapped batch's answer %s (%v): want one ack with gap: true", out, err)
	}
	ss := scrape(t, url+"/metrics")
	if got := ss.sum("kvrouter_events_applied_total", "outcome", "gap"); got != 1 {
		t.Fatalf("kvrouter_events_applied_total{outcome=gap} = %v, want 1", got)
	}
	if got := ss.sum("kvrouter_events_gaps_total"); got != 1 {
		t.Errorf("kvrouter_events_gaps_total = %v after a rank batch acknowledged with a gap (POST /v1/events), want 1", got)
	}
}
