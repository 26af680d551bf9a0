# Sourced by the soak phases (not a phase itself: not executable). measure_capacity prints the largest open-loop
# real-time stream count the sidecar sustains at p99 <= 250 ms with no errors or refusals (bench --arrival
# realtime, bf16, default model) on this machine, now; the bench's report goes to /tmp/soak/capacity.json.
measure_capacity() {  # [JSON_PATH [extra bench arguments...]]: the report goes to JSON_PATH (default below)
  local json=${1:-/tmp/soak/capacity.json}; shift $(( $# > 0 ? 1 : 0 ))
  mkdir -p /tmp/soak
  python3 -m code2wav.sidecar bench --model default --device cuda --dtype bfloat16 --arrival realtime \
      --concurrency "${SOAK_LEVELS:-384,512,640,768}" --frames 101 --no-baselines --json "$json" \
      --sidecar-log "${json%.json}-sidecar.log" "$@" >&2
  CAPACITY_JSON="$json" python3 - <<'PY'
import json, os, sys
rows = json.load(open(os.environ["CAPACITY_JSON"]))["results"]
ok = [r["concurrency"] for r in rows
      if r["errors"] == 0 and not r.get("refused_streams") and r["chunk_latency_ms_p99"] <= 250]
for r in rows:
    print(f"capacity level {r['concurrency']}: p99 {r['chunk_latency_ms_p99']:.1f} ms, errors {r['errors']}, "
          f"refused {r.get('refused_streams')}", file=sys.stderr)
print(max(ok) if ok else min(r["concurrency"] for r in rows) // 2)
PY
}
