# shellcheck shell=bash
# Sourced by the capacity and soak phases (not a phase itself: not executable). measure_capacity prints the most
# open-loop real-time streams the sidecar holds on this machine now, at p99 <= 250 ms with no errors or refusals
# (bench --scenario realtime at the levels SOAK_LEVELS, then python -m code2wav.loadgen.capacity); half the lowest
# level when none held. The bench's report goes to JSON_PATH (default /tmp/soak/capacity.json), its sidecar log beside.
# BENCH_DRIVERS: processes that drive the streams (bench --drivers; default 1): each level's row gives the driving
# process's CPU per second (loadgen_cpu_s_per_s); near 1, the bench rather than the sidecar sets the latencies.
measure_capacity() {  # [JSON_PATH [extra bench arguments...]]
  local json=${1:-/tmp/soak/capacity.json}; shift $(( $# > 0 ? 1 : 0 ))
  mkdir -p /tmp/soak "$(dirname "$json")"
  python3 -m code2wav.sidecar bench --scenario realtime --concurrency "${SOAK_LEVELS:-384,512,640,768}" \
      --drivers "${BENCH_DRIVERS:-1}" --json "$json" --sidecar-log "${json%.json}-sidecar.log" "$@" >&2
  python3 -m code2wav.loadgen.capacity "$json" || true
}
