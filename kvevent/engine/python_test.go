package engine

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"testing"

	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// debianPython is Debian's interpreter, which has python3-msgpack; the
// pyenv python3 on PATH does not.
const debianPython = "/usr/bin/python3"

// pyEncoder encodes the generator's specs (JSON on stdin, one batch a line)
// with python3-msgpack, the way the engines' msgspec encoder lays them out,
// and prints one hex payload a line.
const pyEncoder = `
import json, sys, msgpack

FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality"],
    "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality"],
}

def hashval(e, h):
    enc = e["hash_enc"]
    if enc == 1:
        return h - (1 << 64) if h >= (1 << 63) else h
    if enc == 2:
        return h.to_bytes(8, "big")
    if enc == 3:
        return b"\x11" * 24 + h.to_bytes(8, "big")
    return h

def value(e, name):
    if name == e["bad"]:
        return 7 if name in ("medium", "lora_name", "kv_cache_spec_kind") else "x"
    if name == "block_hashes":
        return None if e["hashes"] is None else [hashval(e, h) for h in e["hashes"]]
    if name == "parent_block_hash":
        return None if e["parent"] is None else hashval(e, e["parent"])
    if name == "token_ids":
        return e["tokens"]
    if name == "extra_keys":
        if not e["extra_keys"]:
            return None
        return [["mm-hash", i] if i % 2 == 1 else None for i in range(len(e["hashes"] or []))]
    key = {"block_size": "block_size", "lora_id": "lora_id", "medium": "medium", "lora_name": "lora_name",
           "group_idx": "group", "kv_cache_spec_kind": "kind", "locality": "locality"}.get(name)
    return e[key] if key else None

def event(e):
    if e["map"]:
        out = {}
        for k in e["order"]:
            if k == "type":
                out["type"] = e["type"]
                continue
            v = value(e, k)
            if v is None and not e["explicit_nil"]:
                continue
            out[k] = v
        if e["extra"]:
            out["ownership"] = [1, "x"]
            out["session_id"] = "rack-7"
        return out
    fields = FIELDS.get(e["type"], [])
    n = 0
    for i, f in enumerate(fields):
        if value(e, f) is not None:
            n = i + 1
    out = [e["type"]] + [value(e, f) for f in fields[:n]]
    if e["extra"]:
        while len(out) <= len(fields):
            out.append(None)
        out += ["ownership?", {"owner": 1}, 2.5]
    return out

for line in sys.stdin:
    b = json.loads(line)
    ts = int(b["ts"]) if b["ts_kind"] == 2 else float(b["ts"])
    events = [event(e) for e in b["events"]]
    if b["form"] == 1:
        batch = [ts, events]
    elif b["form"] == 2:
        batch = {"events": events, "ts": ts}
        if b["dp"] is not None:
            batch["data_parallel_rank"] = b["dp"]
    else:
        batch = [ts, events, b["dp"]]
    print(msgpack.packb(batch, use_bin_type=True, use_single_float=b["ts_kind"] == 1).hex())
`

// TestPythonMsgpackPayloadsDecodeAsGoOnes encodes generated batches with
// python3-msgpack, an encoder this project did not write, and checks that
// the decoder reads them exactly as it reads the same batches encoded here,
// and as the model says.
func TestPythonMsgpackPayloadsDecodeAsGoOnes(t *testing.T) {
	if err := exec.Command(debianPython, "-c", "import msgpack").Run(); err != nil {
		pypub.Missing(t, "%s with msgpack not available: %v", debianPython, err)
	}
	const n = 400
	gen := rapid.Custom(genBatchOf)
	specs := make([]genBatch, n)
	var in bytes.Buffer
	enc := json.NewEncoder(&in)
	for i := range specs {
		specs[i] = gen.Example(i)
		if err := enc.Encode(&specs[i]); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(debianPython, "-c", pyEncoder)
	cmd.Stdin = &in
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python encoder: %v\n%s", err, stderr.String())
	}

	r := kvevent.Rank{Worker: 11, DP: 2}
	fromPy, fromGo := newTestDecoder(t, Config{Rank: r}), newTestDecoder(t, Config{Rank: r})
	m := newModel(r)
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<24)
	i, same, events := 0, 0, 0
	for ; sc.Scan(); i++ {
		if i >= n {
			t.Fatalf("python printed more than %d payloads", n)
		}
		py, err := hex.DecodeString(sc.Text())
		if err != nil {
			t.Fatal(err)
		}
		gob := pack(t, specs[i].encode())
		if bytes.Equal(py, gob) {
			same++
		}
		var bp, bg Batch
		if err := fromPy.Decode(py, &bp); err != nil {
			t.Fatalf("batch %d: python payload: %v\n% x", i, err, py)
		}
		if err := fromGo.Decode(gob, &bg); err != nil {
			t.Fatalf("batch %d: go payload: %v", i, err)
		}
		if !eventsEqual(bp.Events, bg.Events) || bp.TS != bg.TS || bp.DPRank != bg.DPRank || bp.HasDPRank != bg.HasDPRank {
			t.Fatalf("batch %d decodes differently:\npython %s ts %v dp %v/%v\n    go %s ts %v dp %v/%v\npython bytes % x\n    go bytes % x",
				i, fmtEvents(bp.Events), bp.TS, bp.DPRank, bp.HasDPRank, fmtEvents(bg.Events), bg.TS, bg.DPRank, bg.HasDPRank, py, gob)
		}
		assertEvents(t, bp.Events, m.batch(&specs[i]))
		events += len(bp.Events)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if i != n {
		t.Fatalf("python printed %d payloads, want %d", i, n)
	}
	if fromPy.Stats() != fromGo.Stats() {
		t.Fatalf("stats differ:\npython %+v\n    go %+v", fromPy.Stats(), fromGo.Stats())
	}
	t.Logf("%d batches, %d router events, skipped by reason %v; %d byte-identical to the Go encoding", n, events, fromPy.Stats().Skipped, same)
}
