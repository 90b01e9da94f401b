#!/bin/bash
# Every GPU check in one command, within a time budget, for a few minutes on a GPU machine:
# the setup (this checkout's bench/gpu/device_setup.sh on the kit in .gpu/: llama.cpp prebuilt
# or built, this checkout installed), the 0.85 B model written while llama.cpp builds, the
# offload checks (check_offload.py), then rounds of gpu_rounds.py (this server beside
# llama-server at concurrency 1, 16, 64, and a decode-phase load) while time is left. Run it
# from the project's root with the kit in .gpu/ (bench/gpu/make_kit.sh):
#
#   bash bench/gpu/device_run.sh [OUT_DIR]        # default: $OUT, else ./gpu-out
#
# A second run on the same machine finds the build and the model in $GPU_WORK and goes straight
# to the checks, so a first call can set up and a second measure. What it learns is in OUT_DIR
# as soon as it is known, in at most six files (for runners that bring back only a few):
# progress.log (each phase with its second and its outcome), devices.txt (serve --list-devices),
# offload-check.json, gpu-rounds.md (rewritten after every load) and gpu-rounds.jsonl, and
# details.tar.gz, packed again after every phase, with the rest: gpu.txt (nvidia-smi),
# setup.log and the setup's own logs where it failed, model.log, offload-check.log,
# gpu-rounds.log, and every server's log under logs/.
# Environment: BUDGET_S (seconds this run may take, default 570: a phase that cannot finish in
# what is left is skipped and says so), GPU_WORK (/tmp/gw), MODEL (default
# $GPU_WORK/bench-0.85b-f16.gguf, written when missing), CHECKS (0: skip the offload checks),
# HOST_CPU (1: time the host's work between two decodes, bench/host_cpu.py, before the rounds),
# ROUNDS (gpu_rounds.py's rounds, default 1; 0 skips them), CONCURRENCY (default 1,16,64),
# DECODE_TOKENS (gpu_rounds.py's --decode-tokens, default 384; 0: no decode-phase load),
# THREADS (both servers' threads, default half the cores), OURS_ARGS (default '-fa off
# --kv-type f16': llama-server's kernels), SETUP (0: no kit setup; the packages are already
# importable and LLAMA_SERVER is set), PYTHON (default python3), plus device_setup.sh's own
# (CUDA_ARCH, CUDA, PROJECT_SRC: default this checkout, so the package installed is the one
# these scripts came with).
set -u
OUT_DIR=${1:-${OUT:-./gpu-out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
ROOT=$(pwd)
BUDGET=${BUDGET_S:-570}
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
  [[ -d .gpu ]] || { say "no .gpu/ here: run bench/gpu/make_kit.sh first and carry .gpu"; exit 1; }
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
  say "setup ended ($rc): $(tail -1 "$D/setup.log")"
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

# 2. What llama.cpp sees.
timeout -k 5 120 "$PY" -m skippy_scheduler.cli serve --list-devices > "$OUT_DIR/devices.txt" 2>&1
say "devices: $(tr '\n' ';' < "$OUT_DIR/devices.txt" | head -c 300)"

# 3. The offload checks (every layer on the GPU with no flag, the openai client, greedy tokens
#    alone against batched with the exact settings).
# Each phase is cut at CHECKS_S / ROUNDS_S seconds at most (and at what the budget leaves);
# each server start and request in it is bounded too, so a hang costs minutes, not the run.
if [[ ${CHECKS:-1} != 0 ]]; then
  if (( $(left) > 120 )); then
    cap=$(( $(left) - 20 )); (( cap > ${CHECKS_S:-240} )) && cap=${CHECKS_S:-240}
    say "offload checks (at most ${cap}s)"
    timeout -s INT -k 30 "$cap" "$PY" "$ROOT/bench/gpu/check_offload.py" --model "$MODEL" \
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

# 4. With HOST_CPU=1: the host's own time between two decodes (bench/host_cpu.py: `run` with
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
      timeout -s INT -k 10 60 "$PY" "$ROOT/bench/host_cpu.py" --label "$label" \
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

# 5. The table: this server beside llama-server, as many rounds as asked while time is left.
if [[ ${ROUNDS:-1} != 0 ]]; then
  if (( $(left) > 150 )); then
    cap=$(( $(left) - 25 )); (( cap > ${ROUNDS_S:-600} )) && cap=${ROUNDS_S:-600}
    say "gpu_rounds: ${ROUNDS:-1} round(s) at concurrency ${CONCURRENCY:-1,16,64}, decode phase ${DECODE_TOKENS:-384} tokens, $THREADS threads (at most ${cap}s)"
    timeout -s INT -k 15 "$cap" "$PY" "$ROOT/bench/gpu_rounds.py" --model "$MODEL" \
      --rounds "${ROUNDS:-1}" --concurrency "${CONCURRENCY:-1,16,64}" \
      --decode-tokens "${DECODE_TOKENS:-384}" --threads "$THREADS" \
      --timeout 60 --start-timeout 150 --load-timeout 240 \
      --ours-args="${OURS_ARGS:--fa off --kv-type f16}" --markdown "$OUT_DIR/gpu-rounds.md" \
      --json "$OUT_DIR/gpu-rounds.jsonl" --logs "$D/logs/rounds" > "$D/gpu-rounds.log" 2>&1
    rc=$?
    n=$(grep -c '"label": "medians"' "$OUT_DIR/gpu-rounds.jsonl" 2> /dev/null); : "${n:=0}"
    say "gpu_rounds ended ($rc): $n load(s) summarised; last: $(grep '^#' "$D/gpu-rounds.log" | tail -2 | tr '\n' ';' | head -c 400)"
  else
    say "gpu_rounds skipped: $(left)s left"
  fi
fi
pack
say "done"
