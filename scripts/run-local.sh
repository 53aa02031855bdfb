#!/usr/bin/env bash
# make run: a local 3-node kvrouter cluster on loopback.
#
# Builds the binaries, starts three nodes (data under ./data/nodeN), waits
# until every node is ready, prints the addresses and `kvctl status`, then
# replays the synthetic trace through the cluster with simulated workers
# (kvsim replay --live): each simulated worker publishes its KV events on
# its own ZMQ engine wire (tcp://127.0.0.1:5600+i, replays on 5700+i), as
# vLLM does, and one kvagent per worker follows that stream, publishes the
# events to the nodes' NATS and registers the worker. The replay routes
# through the cluster's API, whose index learns the workers' caches only
# from those events. It keeps serving until Ctrl-C, when it stops every
# agent and node cleanly; a replay that fails stops them too, the run
# ending with kvsim's status. Set KVROUTER_RUN_REPLAY=0 to skip the replay (and
# the agents), KVROUTER_RUN_TRACE to replay another trace file,
# KVROUTER_RUN_REQUESTS (600; 0: the whole trace) and KVROUTER_RUN_WORKERS
# (4, at most 100) to size it, and
# KVROUTER_RUN_DIR (data) for the nodes' data and the logs; a relative
# path is from the directory the script starts in. README.md lists them.
set -euo pipefail
# Relative paths in KVROUTER_RUN_DIR and KVROUTER_RUN_TRACE are the
# caller's: made absolute before the cd to the repository's root.
for v in KVROUTER_RUN_DIR KVROUTER_RUN_TRACE; do
  if [ -n "${!v:-}" ] && [[ ${!v} != /* ]]; then
    printf -v "$v" '%s/%s' "$PWD" "${!v}"
  fi
done
cd "$(dirname "$0")/.."

# The sizes are checked before anything starts (status 2, a usage error):
# a value kvsim refuses would otherwise fail the replay with the cluster
# and the agents already up. Worker i (1-based) has its engine wire on
# 5599+i and its replay on 5699+i, so past 100 workers an engine wire
# would take worker 1's replay port.
# whole VALUE LO HI: VALUE is a whole number (decimal) from LO to HI.
whole() {
  [[ $1 =~ ^[0-9]{1,9}$ ]] && [ $((10#$1)) -ge "$2" ] && [ $((10#$1)) -le "$3" ]
}
# KVROUTER_RUN_REQUESTS is read by a replay only: with
# KVROUTER_RUN_REPLAY=0, or no trace (the run then serves routes without
# one), a value nothing uses refuses nothing. KVROUTER_RUN_WORKERS is
# checked always (it sizes the agents and the ports checked below).
trace=${KVROUTER_RUN_TRACE:-traces/mooncake_synthetic_trace.jsonl}
replay=0
[ "${KVROUTER_RUN_REPLAY:-1}" != 0 ] && [ -f "$trace" ] && replay=1
if [ "$replay" = 1 ] && ! whole "${KVROUTER_RUN_REQUESTS:-600}" 0 999999999; then
  echo "KVROUTER_RUN_REQUESTS=${KVROUTER_RUN_REQUESTS}: want a whole number, the requests to replay (0: the whole trace)" >&2
  exit 2
fi
if ! whole "${KVROUTER_RUN_WORKERS:-4}" 1 100; then
  echo "KVROUTER_RUN_WORKERS=${KVROUTER_RUN_WORKERS}: want a whole number from 1 to 100, the simulated workers (engine wires on ports 5600+, replays on 5700+)" >&2
  exit 2
fi
requests=0
[ "$replay" = 1 ] && requests=$((10#${KVROUTER_RUN_REQUESTS:-600}))
workers=$((10#${KVROUTER_RUN_WORKERS:-4}))

# interrupted ends a run stopped (Ctrl-C, SIGTERM) before it started
# anything: status 130, as a shell's for a Ctrl-C, with nothing to stop.
interrupted() {
  trap '' INT TERM HUP
  trap - EXIT
  echo "make run: interrupted before anything started" >&2
  exit 130
}
# Set before the build: without it a Ctrl-C during the build ended the
# script with it, saying nothing, and a build that finished anyway (a
# child that handles SIGINT) went on to start the cluster. bash runs the
# trap once the build has ended.
trap interrupted INT TERM HUP
make -s build
base=${KVROUTER_RUN_DIR:-data}
mkdir -p "$base"
peers=""
for i in 1 2 3; do
  peers+="n$i=127.0.0.1:$((7100 + i))=127.0.0.1:$((7180 + i)),"
done
peers=${peers%,}
endpoints="127.0.0.1:7181,127.0.0.1:7182,127.0.0.1:7183"

pids=()
agents=()
replayer="" # kvsim, while it replays
# started: whether this run has started a node. A run refused before
# (a port in use: most likely another run's, whose data directory this
# may well be) stopped nothing, and must not advise removing the data.
started=0
sleeper=""
# stop_all stops processes: SIGTERM (a script's background jobs ignore
# SIGINT until they install their own handler, so a node still starting
# would not hear it), then, past 20 s, SIGKILL.
stop_all() {
  for p in "$@"; do kill -TERM "$p" 2>/dev/null || true; done
  local deadline=$((SECONDS + 20))
  for p in "$@"; do
    while kill -0 "$p" 2>/dev/null; do
      if [ $SECONDS -gt $deadline ]; then
        echo "process $p did not stop within 20s: killing it" >&2
        kill -KILL "$p" 2>/dev/null || true
        break
      fi
      sleep 0.1
    done
    wait "$p" 2>/dev/null || true
  done
}

# stop ends the run: status 0 on Ctrl-C or SIGTERM (a clean stop; 130,
# interrupted, before it started a node), and the script's own status
# when it ends by itself (a failure stays one).
stop() {
  local code=${1:-0}
  if [ "$code" = signal ]; then
    [ "$started" = 0 ] && interrupted
    code=0
  fi
  # Ignored, not reset to their default: a second Ctrl-C while the agents
  # stop would kill the script before it has stopped the nodes, which run
  # in sessions of their own and would go on holding their ports.
  trap '' INT TERM HUP
  trap - EXIT
  if [ "$started" = 0 ]; then
    exit "$code"
  fi
  echo
  if [ -n "$replayer" ]; then
    echo "stopping the replay..."
    stop_all "$replayer"
  fi
  if [ ${#agents[@]} -gt 0 ]; then
    echo "stopping the agents..."
    stop_all "${agents[@]}"
  fi
  if [ ${#pids[@]} -gt 0 ]; then
    echo "stopping the cluster..."
    stop_all "${pids[@]}"
  fi
  [ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null || true
  echo "stopped; data kept in $base/ (rm -rf $base to start afresh)"
  exit "$code"
}
trap 'stop signal' INT TERM HUP
trap 'stop $?' EXIT

# Every port this run listens on must be free: a node that cannot bind
# exits, and another cluster answering on its HTTP port would be taken
# for it (the replay would then clear that cluster's workers).
# The agents' ports only when a replay will run (replay, above).
ports=""
for i in 1 2 3; do ports+=" $((7100 + i)) $((7180 + i)) $((4220 + i)) $((6220 + i))"; done
if [ "$replay" = 1 ]; then
  for i in $(seq 1 "$workers"); do ports+=" $((5600 + i - 1)) $((5700 + i - 1))"; done
fi
for p in $ports; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    echo "port $p on 127.0.0.1 is in use (another make run, or a cluster of yours?): stop it first" >&2
    exit 1
  fi
done

natsroutes=""
for i in 1 2 3; do natsroutes+="127.0.0.1:$((6220 + i)),"; done
started=1
for i in 1 2 3; do
  # Each in a session of its own (setsid): a Ctrl-C at the terminal
  # reaches this script alone, whose SIGTERM then stops the node once.
  # Given both, a node stopping on the first could be killed by the
  # second, half-way through its shutdown.
  setsid ./bin/kvrouter --node-id "n$i" --raft-addr "127.0.0.1:$((7100 + i))" --http-addr "127.0.0.1:$((7180 + i))" \
    --data-dir "$base/node$i" --peers "$peers" --log-level warn \
    --nats-addr "127.0.0.1:$((4220 + i))" --nats-cluster-addr "127.0.0.1:$((6220 + i))" --nats-routes "${natsroutes%,}" \
    2>"$base/node$i.log" &
  pids+=($!)
done

# ready PORT: whether the node's /readyz on 127.0.0.1:PORT answers 200
# (bash's /dev/tcp: no curl on a fresh machine).
ready() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    IFS= read -r -t 2 status <&3 || exit 1
    [[ $status == "HTTP/1."?" 200 "* ]]
  ) 2>/dev/null
}

echo "waiting for the cluster to be ready..."
deadline=$((SECONDS + 60))
for i in 1 2 3; do
  until ready $((7180 + i)); do
    if ! kill -0 "${pids[i - 1]}" 2>/dev/null; then
      echo "node n$i exited; its log:" >&2
      tail -20 "$base/node$i.log" >&2
      exit 1
    fi
    if [ $SECONDS -gt $deadline ]; then
      echo "node n$i is not ready after 60s; its log:" >&2
      tail -20 "$base/node$i.log" >&2
      exit 1
    fi
    sleep 0.2
  done
done
# The answers must be our nodes': each is still running.
for i in 1 2 3; do
  if ! kill -0 "${pids[i - 1]}" 2>/dev/null; then
    echo "node n$i exited; its log:" >&2
    tail -20 "$base/node$i.log" >&2
    exit 1
  fi
done
echo
echo "kvrouter cluster on loopback:"
for i in 1 2 3; do
  echo "  n$i  http://127.0.0.1:$((7180 + i))  (raft 127.0.0.1:$((7100 + i)), NATS nats://127.0.0.1:$((4220 + i)), log $base/node$i.log)"
done
echo
# A node that stops answering right then must not end the run (set -e):
# the cluster is up, and the loop below says when a node exits.
./bin/kvctl --endpoints "$endpoints" status || echo "(kvctl status failed: see above; going on)"
echo

if [ "${KVROUTER_RUN_REPLAY:-1}" != 0 ] && [ ! -f "$trace" ]; then
  echo "no trace at $trace (set KVROUTER_RUN_TRACE to a Mooncake JSONL file): serving routes without a replay"
  echo
fi
if [ "$replay" = 1 ]; then
  blocksize=16                     # kvsim's v1 block size
  capacity=$((1000000 / blocksize)) # kvsim's v1 capacity (1,000,000 tokens), in blocks
  natsurls="nats://127.0.0.1:4221,nats://127.0.0.1:4222,nats://127.0.0.1:4223"
  for i in $(seq 1 "$workers"); do
    setsid ./bin/kvagent --worker-id "$i" --block-size "$blocksize" --capacity-device "$capacity" \
      --engine-endpoint "tcp://127.0.0.1:$((5600 + i - 1))" --replay-endpoint "tcp://127.0.0.1:$((5700 + i - 1))" \
      --nats-url "$natsurls" --router "$endpoints" --metrics-addr "" --log-level warn \
      2>"$base/kvagent$i.log" &
    agents+=($!)
  done
  echo "kvagents for simulated workers 1..$workers: engine wires tcp://127.0.0.1:5600..$((5600 + workers - 1)), NATS $natsurls (logs $base/kvagentN.log)"
  echo
  # In the background, waited for: bash runs a trap only once the
  # command in the foreground has ended, so a SIGTERM during the replay
  # waited for the whole replay. A signal now ends the wait at once, and
  # stop stops kvsim first.
  ./bin/kvsim replay --live --endpoints "$endpoints" --trace "$trace" \
    --workers "$workers" --limit "$requests" \
    --zmq-base-port 5600 --zmq-replay-base-port 5700 --agent-wait 60s &
  replayer=$!
  # A replay that fails (a malformed trace, a value kvsim refuses) ends
  # the run with its status, the agents and the nodes stopped as on
  # Ctrl-C, instead of serving routes as if it had run. A signal during
  # the wait runs its trap, which stops everything and exits first.
  replay_status=0
  wait "$replayer" || replay_status=$?
  replayer=""
  if [ "$replay_status" != 0 ]; then
    echo "the replay failed (exit $replay_status): see kvsim's message above; stopping the run" >&2
    exit "$replay_status"
  fi
  echo
  ./bin/kvctl --endpoints "$endpoints" workers || true
  echo
  ./bin/kvctl --endpoints "$endpoints" status || true
fi

echo
echo "serving routes: try  ./bin/kvctl --endpoints $endpoints route --hashes 1,2,3"
echo "Ctrl-C stops the cluster."
# Say so when a node exits (killed to try a failover, or crashed); the
# others go on serving.
gone=(0 0 0)
while true; do
  sleep 5 & sleeper=$!
  wait "$sleeper" || true
  for i in 1 2 3; do
    if [ "${gone[i - 1]}" = 0 ] && ! kill -0 "${pids[i - 1]}" 2>/dev/null; then
      gone[i - 1]=1
      echo "node n$i exited (log $base/node$i.log); the others go on serving" >&2
    fi
  done
done
