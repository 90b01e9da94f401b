#!/bin/bash
# Every GPU check in one command, within a time budget, for a few minutes on a GPU machine:
# 1. the setup (this checkout's bench/gpu/device_setup.sh on the kit in .gpu/: llama.cpp prebuilt
# or built, this checkout installed), the 0.85 B model written while llama.cpp builds, then
# the phases in the order of their value, each only when the time left allows it:
#   2. `serve --list-devices` (devices.txt), and a load of the model with every layer on the
#      GPU through the package's own backend (bench/gpu/preflight_load.py, at most 60 s): if
#      it dies with a signal (the package's llama.cpp log sink once crashed a GPU load), the
#      rest runs with SKIPPY_LLAMA_LOG=raw (no sink), and progress.log says so;
#   3. one round of gpu_rounds.py (this server beside llama-server at concurrency 1, 16, 64,
#      and a decode-phase load), its table in gpu-rounds.md as soon as each load ends;
#   4. the offload checks (check_offload.py);
#   5. with HOST_CPU=1, the host's own time between two decodes (bench/host_cpu.py);
#   6. further rounds, up to ROUNDS in all, while the time left holds one more (the first
#      round's own duration), appended to gpu-rounds.jsonl; gpu-rounds.md is then the table of
#      all the rounds (gpu_rounds.py --merge). A server that did not start twice is left out
#      of the further rounds.
# Run it from the project's root with the kit in .gpu/ (bench/gpu/make_kit.sh). On a machine
# lent for 15 minutes of device time in all, machine start included, and warm for only
# seconds between calls, it is ONE call of at most 600 s with .gpu carried, the machine given
# back after it:
#
#   ROUNDS=3 HOST_CPU=1 BUDGET_S=540 bash bench/gpu/device_run.sh "$OUT"
#
# What it learns is in OUT_DIR (default: $OUT, else ./gpu-out) as soon as it is known, in at
# most six files (for runners that bring back only a few): progress.log (each phase with its
# second and its outcome), devices.txt (serve --list-devices), gpu-rounds.md and
# gpu-rounds.jsonl, offload-check.json, and details.tar.gz, packed again after every phase,
# with the rest: gpu.txt (nvidia-smi), setup.log and the setup's own logs where it failed,
# model.log, preflight.log, gpu-rounds.log, offload-check.log, host-cpu*, and every server's
# log under logs/. A second run on the same machine finds the build, the installed project
# (unless its sources changed) and the model in $GPU_WORK and goes straight to the
# measurements.
# Environment: BUDGET_S (seconds this run may take, default 540: a phase that cannot finish in
# what is left is skipped and says so), GPU_WORK (/tmp/gw), MODEL (default
# $GPU_WORK/bench-0.85b-f16.gguf, written when missing), CHECKS (0: skip the offload checks;
# CHECKS_S, their limit, default 240 s), HOST_CPU (1: time the host's work between two
# decodes), ROUNDS (gpu_rounds.py's rounds in all, default 1; 0 skips them; ROUND_S, the
# first round's limit, default 300 s), CONCURRENCY (default 1,16,64), DECODE_TOKENS
# (gpu_rounds.py's --decode-tokens, default 384; 0: no decode-phase load), SERVERS
# (gpu_rounds.py's --servers, default both), ROUNDS_ARGS (more gpu_rounds.py flags, e.g. a
# smaller workload for a try on a CPU: '--prompt-tokens 24 --shared-prefix 16 --max-tokens 4
# --lanes 2 --ctx-size 1024 --requests 3'), THREADS (both servers' threads, default half the
# cores), OURS_ARGS (default '-fa off --kv-type f16': llama-server's kernels), SETUP (0: no kit
# setup; the packages are already importable and LLAMA_SERVER is set), PYTHON (default
# python3), plus device_setup.sh's own (CUDA_ARCH, CUDA, STEP_S, PROJECT_SRC: default this
# checkout, so the package installed is the one these scripts came with).
set -u
ulimit -c 0 2> /dev/null  # a crashing server writes no core dump of its GPU memory and model
OUT_DIR=${1:-${OUT:-./gpu-out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
ROOT=$(pwd)
BUDGET=${BUDGET_S:-540}
W=${GPU_WORK:-/tmp/gw}
export GPU_WORK=$W
MODEL=${MODEL:-$W/bench-0.85b-f16.gguf}
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
cores=$(nproc 2> /dev/null || echo 2)
THREADS=${THREADS:-$(( cores > 1 ? cores / 2 : 1 ))}
mkdir -p "$W"
D=$W/run-details  # what goes back packed in details.tar.gz
rm -rf "$D"; mkdir -p "$D/logs"
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
# A phase's limit: `n` seconds, or what is left of the budget less 30 s where that is less (at
# least 5): a slow setup leaves the later phases less, not the whole run past the device's limit.
within() { local n=$1 l=$(( $(left) - 30 )); (( l < n )) && n=$l; (( n < 5 )) && n=5; echo "$n"; }
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$OUT_DIR/progress.log" >&2; }
# tar's status 1 is "a file changed as it was read" (a log still written): the archive is whole.
pack() { tar czf "$OUT_DIR/details.tar.gz.part" -C "$D" . 2> /dev/null; (( $? <= 1 )) \
  && mv "$OUT_DIR/details.tar.gz.part" "$OUT_DIR/details.tar.gz"; }
trap pack EXIT

say "start: budget ${BUDGET}s, work folder $W, output $OUT_DIR"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv \
    > "$D/gpu.txt" 2>&1
  say "GPU: $(tail -n +2 "$D/gpu.txt" | head -3 | tr '\n' ';')"
else
  say "no nvidia-smi on this machine"
fi

# 1. The kit's setup in the background; the model is written as soon as the project is
#    installed (it needs the compiled core, not llama.cpp), while llama.cpp still builds.
write_model() {
  say "writing the model $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  (cd "$W" && "$PY" "$ROOT/bench/gpu_rounds.py" --write-model "$MODEL.part" \
    > "$D/model.log" 2>&1 && mv "$MODEL.part" "$MODEL")
}
model_pid=
if [[ ${SETUP:-1} != 0 ]]; then
  [[ -d .gpu ]] || { say "no .gpu/ here: run bench/gpu/make_kit.sh on a machine with a package index (with nvcc there it also prebuilds llama.cpp for the GPU) and carry .gpu; without the prebuilt llama.cpp the setup here builds it, at most 270-340 s on 16 cores"; exit 1; }
  pre=.gpu/llama-cuda-sm${CUDA_ARCH:-90}.tar.xz
  if [[ ! -f $pre && ! -x $W/b/bin/llama-server && ${CUDA:-ON} != OFF ]]; then
    say "no prebuilt llama.cpp in the kit ($pre: bench/gpu/make_kit.sh adds it on a machine with nvcc); the setup builds llama.cpp here, at most 270-340 s on 16 cores"
  fi
  rm -f "$W/proj.rc"
  # The setup script of this checkout (the kit's copy where the checkout has none), and the
  # project installed from this checkout unless PROJECT_SRC says otherwise.
  setup=bench/gpu/device_setup.sh; [[ -f $setup ]] || setup=.gpu/device_setup.sh
  PROJECT_SRC=${PROJECT_SRC-$ROOT} BUILD_S=$(( $(left) - 60 )) bash "$setup" > "$D/setup.log" 2>&1 &
  setup_pid=$!
  if [[ ! -f $MODEL ]]; then
    while kill -0 "$setup_pid" 2> /dev/null && [[ ! -f $W/proj.rc ]]; do sleep 2; done
    if [[ -f $W/proj.rc && $(cat "$W/proj.rc") == 0 ]]; then
      ( export PYTHONPATH=$W/projsite:$W/site; write_model ) &
      model_pid=$!
    fi
  fi
  wait "$setup_pid"; rc=$?
  say "setup ended ($rc): $(grep -E 'prebuilt|kept|configure|built' "$D/setup.log" | sed 's/^\[[0-9]*s\] //' | tr '\n' ';' | head -c 600) $(tail -1 "$D/setup.log")"
  if [[ $rc != 0 ]]; then
    [[ -n $model_pid ]] && kill "$model_pid" 2> /dev/null
    for f in cmake.log build.log pip.log proj-install.log prebuilt.log; do
      [[ -f $W/$f ]] && tail -40 "$W/$f" > "$D/setup-$f"
    done
    say "the setup's last lines: $(tail -4 "$D/setup.log" | tr '\n' ';' | head -c 600)"
    exit 1
  fi
  . "$W/env.sh"
fi
if [[ -n $model_pid ]]; then
  wait "$model_pid" || { say "model write failed: $(tail -3 "$D/model.log")"; exit 1; }
elif [[ ! -f $MODEL ]]; then
  write_model || { say "model write failed: $(tail -3 "$D/model.log")"; exit 1; }
fi
say "model ready: $(du -h "$MODEL" | cut -f1)"
pack
cd "$W" || exit 1  # outside the checkout: python -m imports the installed package

ROUNDS=${ROUNDS:-1}
JSONL=$OUT_DIR/gpu-rounds.jsonl
# One run of gpu_rounds.py of one round: the round's number, its limit in seconds, its table,
# its servers. Every run appends to the same JSON lines; progress.log gets its summary.
one_round() {
  say "gpu_rounds: round $1 of $ROUNDS ($4) at concurrency ${CONCURRENCY:-1,16,64}, decode phase ${DECODE_TOKENS:-384} tokens, $THREADS threads (at most ${2}s)"
  # shellcheck disable=SC2086
  timeout -s TERM -k 15 "$2" "$PY" "$ROOT/bench/gpu_rounds.py" --model "$MODEL" --rounds 1 \
    --servers "$4" --concurrency "${CONCURRENCY:-1,16,64}" \
    --decode-tokens "${DECODE_TOKENS:-384}" --threads "$THREADS" \
    --timeout 60 --start-timeout 60 --start-failures 2 --load-timeout 240 \
    --ours-args="${OURS_ARGS:--fa off --kv-type f16}" --markdown "$3" \
    --json "$JSONL" --logs "$D/logs/rounds" ${ROUNDS_ARGS:-} >> "$D/gpu-rounds.log" 2>&1
  local rc=$?
  say "gpu_rounds round $1 ended ($rc): $(grep -E '^# (round|  |.* skipped)' "$D/gpu-rounds.log" | tail -3 | tr '\n' ';' | head -c 500)"
}
# The servers that have not failed to start twice so far (gpu_rounds.py's --servers; none).
servers_left() {
  "$PY" -c '
import json, sys
fails = {}
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    try:
        row = json.loads(line)
    except ValueError:
        continue
    if isinstance(row, dict) and row.get("start_failed"):
        fails[row["label"]] = fails.get(row["label"], 0) + 1
ours = sys.argv[2] != "theirs" and fails.get("skippy-scheduler", 0) < 2
theirs = sys.argv[2] != "ours" and fails.get("llama-server", 0) < 2
print("both" if ours and theirs else "ours" if ours else "theirs" if theirs else "none")' \
    "$JSONL" "${SERVERS:-both}" 2> /dev/null || echo "${SERVERS:-both}"
}

# 2. What llama.cpp sees, and a load with every layer on the GPU through the package's own
#    backend (log sink included): a crash there would take every server of this package down.
timeout -k 5 "$(within 120)" "$PY" -m skippy_scheduler.cli serve --list-devices \
  > "$OUT_DIR/devices.txt" 2>&1
say "devices: $(tr '\n' ';' < "$OUT_DIR/devices.txt" | head -c 300)"
preflight() {
  timeout -s TERM -k 5 "$(within 60)" "$PY" -X faulthandler "$ROOT/bench/gpu/preflight_load.py" \
    --model "$MODEL" >> "$D/preflight.log" 2>&1
}
preflight; rc=$?
# SIGSEGV or SIGBUS: the crash the log sink was seen to cause; an abort (a GGML_ASSERT, a CUDA
# error) says nothing about the sink, and keeps it.
if (( rc == 128 + 11 || rc == 128 + 7 )); then
  say "preflight load died with signal $((rc - 128)): $(grep -m1 -E 'Fatal Python error|Segmentation' "$D/preflight.log" | head -c 200); the rest runs with SKIPPY_LLAMA_LOG=raw (no llama.cpp log sink)"
  export SKIPPY_LLAMA_LOG=raw
  if (( $(left) > 150 )); then
    preflight; rc=$?
    say "preflight load with SKIPPY_LLAMA_LOG=raw ended ($rc): $(tail -1 "$D/preflight.log" | head -c 300)"
  fi
elif (( rc >= 128 && rc != 137 )); then  # 137: still running after the limit and killed
  say "preflight load died with signal $((rc - 128)): $(grep -m1 -E 'Fatal Python error|Aborted|GGML_ASSERT|CUDA error' "$D/preflight.log" | head -c 200)"
elif (( rc == 124 || rc == 137 )); then
  say "preflight load: no answer in 60 s (the rest goes on with the package's log sink)"
else
  say "preflight load ended ($rc): $(tail -1 "$D/preflight.log" | head -c 300)"
fi
pack

# 3. The first round of the table, this server beside llama-server: the result that matters
#    most, so it comes first.
round_s=0
if (( ROUNDS > 0 )); then
  if (( $(left) > 120 )); then
    cap=$(( $(left) - 25 )); (( cap > ${ROUND_S:-300} )) && cap=${ROUND_S:-300}
    t=$SECONDS
    one_round 1 "$cap" "$OUT_DIR/gpu-rounds.md" "${SERVERS:-both}"
    round_s=$(( SECONDS - t ))
  else
    say "gpu_rounds skipped: $(left)s left"
  fi
  pack
fi

# 4. The offload checks (every layer on the GPU with no flag, the openai client, greedy tokens
#    alone against batched with the exact settings, the GPU path against the host's).
# Each phase is cut at what the budget leaves (the checks at CHECKS_S); each server start and
# request in it is bounded too, so a hang costs minutes, not the run.
if [[ ${CHECKS:-1} != 0 ]]; then
  if (( $(left) > 120 )); then
    cap=$(( $(left) - 20 )); (( cap > ${CHECKS_S:-240} )) && cap=${CHECKS_S:-240}
    say "offload checks (at most ${cap}s)"
    timeout -s TERM -k 30 "$cap" "$PY" "$ROOT/bench/gpu/check_offload.py" --model "$MODEL" \
      --timeout 90 --json "$OUT_DIR/offload-check.json" --logs "$D/logs/checks" \
      > "$D/offload-check.log" 2>&1
    rc=$?
    say "offload checks ended ($rc): $("$PY" -c '
import json, sys
d = json.load(open(sys.argv[1]))
o, b, f = d.get("offload", {}), d.get("batch_invariance", {}), d.get("in_flight", {})
print("all layers on a GPU:", o.get("all_layers_on_gpu"), "| chat answered:", o.get("chat_answered"),
      "| greedy alone = batched:", b.get("equal"), "of", b.get("requests"),
      "| depth 2 + device sampling = depth 1 + host:", f.get("equal"), "of", f.get("requests"),
      "| sampled on the device:", f.get("device_sampling"),
      "| plans staged ahead:", f.get("staged_ahead"), "|", o.get("startup_line"),
      *("| %s failed: %s" % (k, " ".join(v["error"][:300].split())) for k, v in d.items()
        if isinstance(v, dict) and v.get("error")),
      "| interrupted" if d.get("interrupted") else "")' "$OUT_DIR/offload-check.json" 2>&1 | tail -1)"
  else
    say "offload checks skipped: $(left)s left"
  fi
  pack
fi

# 5. With HOST_CPU=1: the host's own time between two decodes (bench/host_cpu.py: `run` with
#    64 prompts of 256 tokens, this server's settings), sampling on the host, then on the
#    device, then on the device without the next plan staged while one runs.
if [[ ${HOST_CPU:-0} != 0 ]]; then
  "$PY" "$ROOT/bench/host_cpu.py" --write-prompts "$W/host-cpu-prompts.json" --count 64
  for v in off on on-noahead; do
    bs=${v%%-*}; extra=""; label="bs-$v"
    [[ $v == on-noahead ]] && extra="--stage-ahead off"
    what="-bs $bs${extra:+ $extra}"
    if (( $(left) > 90 )); then
      say "host_cpu $what (at most 60s)"
      # shellcheck disable=SC2086
      timeout -s TERM -k 10 60 "$PY" "$ROOT/bench/host_cpu.py" --label "$label" \
        --json "$D/host-cpu.jsonl" -- -m "$MODEL" --prompts "$W/host-cpu-prompts.json" \
        -n 256 -np 64 -t "$THREADS" ${OURS_ARGS:--fa off --kv-type f16} -bs "$bs" $extra \
        > "$D/host-cpu-$v.log" 2>&1
      rc=$?
      say "host_cpu $what ended ($rc): $(tail -1 "$D/host-cpu-$v.log" | head -c 600)"
    else
      say "host_cpu $what skipped: $(left)s left"
    fi
  done
  pack
fi

# 6. Further rounds while the time left holds one more (the first round's own duration, a
#    tenth more, and 20 s for the table), each appended to the JSON lines; the table is then
#    made again from all of them.
if (( ROUNDS > 1 && round_s > 0 )); then
  need=$(( round_s + round_s / 10 + 20 ))
  for (( r = 2; r <= ROUNDS; r++ )); do
    servers=$(servers_left)
    if [[ $servers == none ]]; then
      say "gpu_rounds: rounds $r-$ROUNDS skipped: no server started twice"; break
    elif (( $(left) < need )); then
      say "gpu_rounds: rounds $r-$ROUNDS skipped: $(left)s left, a round took ${round_s}s"; break
    fi
    one_round "$r" $(( $(left) - 20 )) "$D/gpu-rounds-$r.md" "$servers"
    "$PY" "$ROOT/bench/gpu_rounds.py" --merge "$JSONL" --markdown "$OUT_DIR/gpu-rounds.md" \
      > "$D/gpu-rounds-merge.log" 2>&1 \
      || say "gpu_rounds --merge failed: $(tail -2 "$D/gpu-rounds-merge.log" | tr '\n' ';' | head -c 300)"
    pack
  done
fi
if [[ -f $OUT_DIR/gpu-rounds.md ]]; then
  say "gpu-rounds.md: $(grep -m1 -o 'medians of [0-9]* alternating rounds' "$OUT_DIR/gpu-rounds.md")$(grep -E '^- (rounds per load|[0-9]+ load\(s\) failed|.* skipped for|interrupted)' "$OUT_DIR/gpu-rounds.md" | tr '\n' ';' | sed 's/^/; /' | head -c 400)"
fi
pack
say "done"
