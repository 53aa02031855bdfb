"""A stand-in for an engine's KV event publisher, driven by the Go tests.

It speaks wire.md over real libzmq (python3-zmq) and encodes batches with
python3-msgpack, the way vLLM's msgspec encoder lays them out, in both event
encodings (tagged arrays and maps).

Run as `/usr/bin/python3 publisher.py CONFIG`, CONFIG a JSON object:
  pub           the event endpoint
  connect       true to connect it (the subscriber binds); else it is bound
  replay        an endpoint to bind a ROUTER replay socket on, or null
  replay_shape  2: replies are [seq, payload]; 3: [topic, seq, payload]
  topic         the topic frame (default "")
  replay_pace   when set, a replay pauses 1 ms after every this many
                replies, so that libzmq's I/O thread keeps its send queue
                short: a test of the subscriber's receive limit then does
                not also depend on this sender's (1,000 by default)
The event socket is an XPUB: a PUB that also reports subscriptions, so that
"wait_sub" can tell when a subscriber is there (PUB drops what it sends
before then).

It prints {"pub": ..., "replay": ...}, the endpoints with the ports bound,
then reads one command a line on stdin and answers each with one JSON line:
  {"cmd": "wait_sub"}        wait (10 s at most) for a subscription
  {"cmd": "batch", "seq": n, "form": "array"|"map", "dp": n|null,
   "events": [...], "live": bool}
                             encode a batch, keep it for replay, and publish
                             it unless live is false (a batch the PUB dropped)
  {"cmd": "raw", "frames": ["hex", ...]}
                             publish these frames as one message
  {"cmd": "forget_below", "seq": n}
                             drop kept batches below n (an overrun buffer)
Replay requests are served between commands. EOF on stdin ends it.
"""

import json
import os
import sys
import time

import msgpack
import zmq

# vLLM's field order (wire.md); trailing nil fields are left out.
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx"]


def event(e):
    """Encodes one event spec as the engine would."""
    typ = e["type"]
    values = {
        "block_hashes": e.get("hashes"),
        "parent_block_hash": e.get("parent"),
        "token_ids": e.get("tokens"),
        "block_size": e.get("block_size"),
        "lora_id": None,
        "medium": e.get("medium"),
        "lora_name": e.get("lora_name"),
        "extra_keys": e.get("extra_keys"),
        "group_idx": e.get("group_idx"),
        "kv_cache_spec_kind": e.get("kind"),
    }
    if typ == "BlockStored":
        fields = STORED_FIELDS
    elif typ == "BlockRemoved":
        fields = REMOVED_FIELDS
    else:
        fields = []
    if e.get("map"):
        out = {"type": typ}
        for f in fields:
            if values[f] is not None:
                out[f] = values[f]
        return out
    # Tagged array: fields by position, trailing nil fields omitted.
    n = 0
    for i, f in enumerate(fields):
        if values[f] is not None:
            n = i + 1
    return [typ] + [values[f] for f in fields[:n]]


def batch_payload(b):
    ts = 1700000000.25 + b["seq"]
    events = [event(e) for e in b["events"]]
    if b.get("form") == "map":
        batch = {"ts": ts, "events": events}
        if b.get("dp") is not None:
            batch["data_parallel_rank"] = b["dp"]
    elif b.get("dp") is None:
        batch = [ts, events]
    else:
        batch = [ts, events, b["dp"]]
    return msgpack.packb(batch, use_bin_type=True)


def seqframe(seq):
    return seq.to_bytes(8, "big")


def main():
    cfg = json.loads(sys.argv[1])
    topic = cfg.get("topic", "").encode()
    shape = cfg.get("replay_shape", 3)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.setsockopt(zmq.RCVTIMEO, 10000)
    if cfg.get("connect"):
        pub.connect(cfg["pub"])
    else:
        pub.bind(cfg["pub"])
    router = None
    if cfg.get("replay"):
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.bind(cfg["replay"])

    def endpoint(s):
        return s.getsockopt(zmq.LAST_ENDPOINT).decode() if s is not None else None

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"pub": endpoint(pub), "replay": endpoint(router)})

    pace = cfg.get("replay_pace") or 0
    kept = {}  # seq -> payload, the replay buffer
    replies = 0

    def serve_replay():
        nonlocal replies
        msg = router.recv_multipart()
        ident, rest = msg[0], msg[1:]
        # The engine expects what a REQ socket sends: delimiter, start seq.
        if len(rest) != 2 or rest[0] != b"" or len(rest[1]) != 8:
            return
        start = int.from_bytes(rest[1], "big")
        for seq in sorted(s for s in kept if s >= start):
            frames = [seqframe(seq), kept[seq]]
            if shape == 3:
                frames.insert(0, topic)
            router.send_multipart([ident, b""] + frames)
            replies += 1
            if pace and replies % pace == 0:
                time.sleep(0.001)
        router.send_multipart([ident, b""] + ([topic] if shape == 3 else []) + [b"\xff" * 8, b""])

    def command(c):
        op = c["cmd"]
        if op == "wait_sub":
            try:
                msg = pub.recv()
            except zmq.Again:
                return {"ok": False, "err": "no subscriber within 10s"}
            return {"ok": True, "sub": msg.hex()}
        if op == "batch":
            payload = batch_payload(c)
            kept[c["seq"]] = payload
            if c.get("live", True):
                pub.send_multipart([topic, seqframe(c["seq"]), payload])
            return {"ok": True}
        if op == "raw":
            pub.send_multipart([bytes.fromhex(f) for f in c["frames"]])
            return {"ok": True}
        if op == "forget_below":
            for s in [s for s in kept if s < c["seq"]]:
                del kept[s]
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "replies": replies}
        return {"ok": False, "err": "unknown command " + op}

    stdin = sys.stdin.fileno()
    poller = zmq.Poller()
    poller.register(stdin, zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    pending = b""
    while True:
        ready = dict(poller.poll())
        if router is not None and router in ready:
            serve_replay()
        if stdin in ready:
            data = os.read(stdin, 1 << 20)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    reply(command(json.loads(line)))
    pub.close()
    if router is not None:
        router.close()
    ctx.term()


if __name__ == "__main__":
    main()
