#!/usr/bin/env bash
# Verifies a shardtrain bundle on a GPU machine and measures it, by phase:
#
#   launch/gpu-verify.sh tests     GPU list, every bundled test executable (gtest JSON), summary
#   launch/gpu-verify.sh kernels   shardtrain-kernel-bench, PyTorch SDPA on the same attention
#                                  shapes, and the comparison table (target: >= 0.5x SDPA speed)
#   launch/gpu-verify.sh train     `shardtrain check` on the golden case on the GPU, then
#                                  `shardtrain bench` for llama-125m and llama-1b (seq 2048,
#                                  bf16, strategies none and per_layer, fused attention)
#   launch/gpu-verify.sh qlora     `shardtrain bench` of configs/qlora-llama-3.1-8b.yaml on a
#                                  random NF4 base (seq 4096, per_layer): step time, memory
#   launch/gpu-verify.sh cli       `shardtrain train` of configs/tiny.yaml on the GPU, stopped
#                                  by SIGTERM half-way and resumed, against an uninterrupted run
#                                  (every step's loss bit for bit); configs/qlora-tiny.yaml
#                                  trained on the GPU (its PEFT adapter written)
#   launch/gpu-verify.sh profile   Nsight Compute (ncu) on one launch of each fused-attention
#                                  kernel at every attention shape of the kernel bench
#   launch/gpu-verify.sh all       tests, kernels and train in turn, within one budget
#                                  (qlora, cli and profile run on their own)
#
# Run it from the repository root (or as bundle/gpu-verify.sh from a copied bundle) after
# launch/bundle.sh has built bundle/. It sources bundle/env.sh itself. Results go to
# "${OUT:-./gpu-out}", at most 8 files whatever the phase:
#
#   summary.txt   one line per step: PASS/FAIL/TIMEOUT/SKIP, phase, step, seconds, note
#   tests.log     every test executable's output          tests.json    their gtest JSON, merged
#   kernels.log   kernel bench, SDPA and comparison text  kernels.json  the three as one JSON
#   train.log     check and bench output, tables          train.csv     both bench CSVs (+config)
#                                                         train.json    both bench JSONs + checks
#   qlora.log     the QLoRA bench's output and table      qlora.json    its bench JSON
#   cli.log       the three trainings' output              cli.json      both runs' losses
#   profile.txt   ncu's report (speed of light, occupancy, launch, warp state, compute, memory)
#
# Every step runs under `timeout`, and a failing step is recorded and the phase goes on. Each
# phase stops starting new steps after GPU_VERIFY_BUDGET_S seconds (default 480, so that a
# phase fits a 10-minute command with room to spare; docs/benchmarks.md runs tests and kernels
# in one such command with 240 each); `all` counts that budget once for its three phases, so
# it too ends within it (what does not fit is recorded as SKIP). Without a GPU the tests
# phase still runs (CUDA tests skip), and kernels and train record "no CUDA device" and stop.
# Exit status: 0 when every step passed, 1 otherwise, 2 for a usage error.
set -uo pipefail

usage() {
  sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
(($# == 1)) || usage
phase_arg="$1"
case "$phase_arg" in tests | kernels | train | qlora | cli | profile | all) ;; *) usage ;; esac

# ---- where things are ------------------------------------------------------------------------
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -f "$here/env.sh" ]]; then  # bundle/gpu-verify.sh inside a copied bundle
  bundle="$here"
  scripts="$here/bench"
else  # launch/gpu-verify.sh in the repository
  bundle="$(cd "$here/.." && pwd)/bundle"
  scripts="$(cd "$here/.." && pwd)/tests/bench"
fi
if [[ ! -f "$bundle/env.sh" ]]; then
  echo "gpu-verify: no bundle at $bundle (build it with launch/bundle.sh)" >&2
  exit 2
fi
# One process, no launcher: a launcher's variables (left in a login environment, say) would make
# the programs start MPI, which the bundle does not carry.
launcher_vars="$(compgen -e | grep -E '^(OMPI_COMM_WORLD_|PMI_|PMIX_|SLURM_)' || true)"
if [[ -n "$launcher_vars" ]]; then
  echo "gpu-verify: unsetting launcher variables: $(echo $launcher_vars)" >&2
  # shellcheck disable=SC2086
  unset $launcher_vars
fi

# Python (PyTorch) runs with the library path it had: the bundle's libraries are for its own
# programs, and its libstdc++ or libssl must not stand in for the ones PyTorch was built with.
orig_ld_library_path="${LD_LIBRARY_PATH:-}"
# shellcheck source=/dev/null
source "$bundle/env.sh"
[[ -x "$bundle/link-build-paths.sh" ]] && "$bundle/link-build-paths.sh"

out="${OUT:-./gpu-out}"
mkdir -p "$out" || { echo "gpu-verify: cannot create $out" >&2; exit 2; }
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-verify.XXXXXX")"
trap 'rm -rf "$work"' EXIT
summary="$out/summary.txt"
budget="${GPU_VERIFY_BUDGET_S:-480}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
python="$(command -v python3 || true)"
# python3 as a command (usable under timeout), with the library path it had.
py=(env "LD_LIBRARY_PATH=$orig_ld_library_path" "$python")
failures=0

note() { echo "[gpu-verify $(date -u +%H:%M:%S)] $*" >&2; }

# record STATUS PHASE STEP SECONDS [NOTE]: one summary line.
record() {
  local line
  line="$(printf '%-7s %-8s %-50s %4ss  %s' "$1" "$2" "$3" "$4" "${5:-}")"
  echo "$line" >>"$summary"
  note "$line"
  [[ "$1" == PASS ]] || failures=$((failures + 1))
}

phase_start=0
shared_budget=0  # `all`: the phases share one budget
begin_phase() {
  ((shared_budget && phase_start > 0)) || phase_start=$(date +%s)
  note "phase $1: $(remaining)s of the ${budget}s budget left, results in $out"
}
remaining() { echo $((budget - ($(date +%s) - phase_start))); }

# step PHASE NAME LIMIT LOG TEE -- COMMAND...: runs COMMAND under timeout (LIMIT seconds, or
# what is left of the phase budget), appending its output to LOG (and to stdout when TEE is 1),
# and records the result. Returns the command's status.
step() {
  local phase="$1" name="$2" limit="$3" log="$4" show="$5"
  shift 6
  local left
  left=$(remaining)
  if ((left < 15)); then
    record SKIP "$phase" "$name" 0 "phase budget of ${budget}s spent"
    return 125
  fi
  ((limit > left)) && limit=$left
  note "$phase: $name (limit ${limit}s)"
  {
    echo
    echo "===== $phase: $name ($(date -u +%Y-%m-%dT%H:%M:%SZ), limit ${limit}s)"
    echo "\$ $*"
  } >>"$log"
  local start rc
  start=$(date +%s)
  if ((show)); then
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  else
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
  fi
  local seconds=$(($(date +%s) - start))
  echo "===== exit status $rc after ${seconds}s" >>"$log"
  if ((rc == 0)); then
    record PASS "$phase" "$name" "$seconds"
  elif ((rc == 124 || rc == 137)); then
    record TIMEOUT "$phase" "$name" "$seconds" "killed after ${limit}s"
  else
    record FAIL "$phase" "$name" "$seconds" "exit status $rc (see $(basename "$log"))"
  fi
  return "$rc"
}

# nvidia-smi when it is installed; otherwise the driver's device files.
gpu_present() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    # grep reads all of it: with -q it could quit first and, under pipefail, nvidia-smi's
    # SIGPIPE would read as "no GPU".
    nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null
  else
    [[ -e /dev/nvidia0 ]] || [[ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]]
  fi
}

require_gpu() {
  if gpu_present; then return 0; fi
  record FAIL "$1" "GPU check" 0 "no CUDA device (nvidia-smi lists none, or no /dev/nvidia0)"
  echo "no CUDA device: nvidia-smi lists no GPU, or without nvidia-smi there is no" \
    "/dev/nvidia0; phase $1 not run" >>"$2"
  return 1
}

# ---- tests -------------------------------------------------------------------------------------
phase_tests() {
  local log="$out/tests.log"
  begin_phase tests
  : >"$log"
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)"
    if command -v nvidia-smi >/dev/null 2>&1; then
      nvidia-smi -L 2>&1
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    else
      echo "nvidia-smi: not found (no NVIDIA driver here); the cuda_* tests will skip"
    fi
  } | tee -a "$log"
  mkdir -p "$work/gtest"
  local t name ran=0
  for t in "$bundle"/tests/*; do
    [[ -f "$t" && -x "$t" ]] || continue
    name="$(basename "$t")"
    ran=$((ran + 1))
    # 100 s: every executable takes well under a minute on a few cores (all of them together
    # about 25 s on 2 CPU cores); a hang must not take the whole phase.
    step tests "$name" 100 "$log" 0 -- "$t" --gtest_output="json:$work/gtest/$name.json"
  done
  ((ran > 0)) || record FAIL tests "test executables" 0 "none in $bundle/tests"
  # Per executable: tests run, skipped and failed, from its gtest JSON. With a GPU present, a
  # skipped test in a cuda_* executable did not test anything: that is a failure.
  if [[ -n "$python" ]]; then
    local gpu=0 skipped_on_gpu
    gpu_present && gpu=1
    local merged=0
    skipped_on_gpu="$("${py[@]}" - "$work/gtest" "$out/tests.json" "$summary" "$gpu" <<'PY'
import glob, json, os, sys
src, dst, summary, gpu = sys.argv[1:5]
all_skipped = []
merged = {"executables": []}
lines = []
for path in sorted(glob.glob(os.path.join(src, "*.json"))):
    name = os.path.basename(path)[:-5]
    try:
        with open(path) as f:
            g = json.load(f)
    except (OSError, ValueError) as e:
        merged["executables"].append({"name": name, "error": f"unreadable gtest JSON: {e}"})
        continue
    skipped = sum(1 for s in g.get("testsuites", []) for t in s.get("testsuite", [])
                  if t.get("result") == "SKIPPED")
    merged["executables"].append({"name": name, "tests": g.get("tests"),
                                  "failures": g.get("failures"), "skipped": skipped,
                                  "time": g.get("time"), "gtest": g})
    lines.append(f"  {name:<28} {g.get('tests', 0):4} tests, {g.get('failures', 0):3} failed, "
                 f"{skipped:3} skipped")
    if gpu == "1" and name.startswith("cuda_") and skipped > 0:
        all_skipped.append(f"{name} ({skipped} of {g.get('tests')})")
with open(dst, "w") as f:
    json.dump(merged, f, indent=1)
    f.write("\n")
with open(summary, "a") as f:
    f.write("tests per executable (from gtest JSON; an executable that crashed has none):\n")
    f.write("\n".join(lines) + "\n")
print(", ".join(all_skipped))
PY
)" || merged=$?
    if ((merged != 0)); then
      record FAIL tests "test results merged" 0 "the gtest JSON merge failed (status $merged)"
    fi
    if [[ -n "$skipped_on_gpu" ]]; then
      record FAIL tests "CUDA tests ran" 0 \
        "tests skipped although a GPU is present: $skipped_on_gpu"
    fi
  else
    # No Python: the gtest JSON objects, as one array.
    {
      echo "["
      local first=1 j
      for j in "$work"/gtest/*.json; do
        [[ -s "$j" ]] || continue
        ((first)) || echo ","
        first=0
        cat "$j"
      done
      echo "]"
    } >"$out/tests.json"
    # With a GPU present, a skipped test in a cuda_* executable did not test anything.
    if gpu_present; then
      local skipped_on_gpu="" n
      for j in "$work"/gtest/cuda_*.json; do
        [[ -s "$j" ]] || continue
        n=$(grep -c '"result": "SKIPPED"' "$j" || true)
        ((n > 0)) && skipped_on_gpu+="${skipped_on_gpu:+, }$(basename "$j" .json) ($n)"
      done
      if [[ -n "$skipped_on_gpu" ]]; then
        record FAIL tests "CUDA tests ran" 0 \
          "tests skipped although a GPU is present: $skipped_on_gpu"
      fi
    fi
  fi
}

# ---- kernels -----------------------------------------------------------------------------------
phase_kernels() {
  local log="$out/kernels.log"
  begin_phase kernels
  : >"$log"
  require_gpu kernels "$log" || return 0
  local kb="$work/kernel-bench.json" sdpa="$work/sdpa.json" cmp="$work/compare.json"
  # About 30 s on an H100 (20 timed runs of each kernel and attention shape); 150 s leaves room
  # for a slow first run of untuned kernels, and for SDPA after a hang.
  step kernels "shardtrain-kernel-bench" 150 "$log" 1 -- \
    "$bundle/bin/shardtrain-kernel-bench" --json "$kb"
  if [[ -z "$python" ]]; then
    record FAIL kernels "sdpa_reference.py" 0 "no python3 here"
  else
    local shapes=()
    [[ -s "$kb" ]] && shapes=(--shapes-from "$kb")
    # 6 shapes x 4 SDPA backends x 3 figures of 23 runs each: well under a minute.
    step kernels "sdpa_reference.py" 180 "$log" 1 -- \
      "${py[@]}" "$scripts/sdpa_reference.py" "${shapes[@]}" --json "$sdpa"
    if [[ -s "$kb" && -s "$sdpa" ]]; then
      step kernels "attention >= 0.5x SDPA (default backend)" 60 "$log" 1 -- \
        "${py[@]}" "$scripts/compare_attention.py" "$kb" "$sdpa" --json "$cmp"
      # The one-pass backward (activation.attention_backward=atomic_dq) against the same figures.
      step kernels "attention >= 0.5x SDPA, atomic_dq backward" 60 "$log" 1 -- \
        "${py[@]}" "$scripts/compare_attention.py" "$kb" "$sdpa" --variant atomic_dq
      # The fastest SDPA backend per shape, for reference (not a pass/fail step).
      echo >>"$log"
      "${py[@]}" "$scripts/compare_attention.py" "$kb" "$sdpa" --backend best 2>&1 | tee -a "$log"
      # The deterministic backward with one 16-key m-tile a warp in its dK/dV kernel (the
      # default takes two at head dim 64; timed there only), for reference.
      echo >>"$log"
      "${py[@]}" "$scripts/compare_attention.py" "$kb" "$sdpa" --variant one_key_mtile 2>&1 |
        tee -a "$log"
      # The same for the one-pass backward, whose two-m-tile form spills a few registers.
      echo >>"$log"
      "${py[@]}" "$scripts/compare_attention.py" "$kb" "$sdpa" --variant atomic_dq_one_key_mtile \
        2>&1 | tee -a "$log"
    else
      record SKIP kernels "attention comparison" 0 "kernel bench or SDPA figures missing"
    fi
    "${py[@]}" - "$kb" "$sdpa" "$cmp" "$out/kernels.json" <<'PY'
import json, sys
*parts, dst = sys.argv[1:]
merged = {}
for key, path in zip(("kernel_bench", "sdpa", "comparison"), parts):
    try:
        with open(path) as f:
            merged[key] = json.load(f)
    except (OSError, ValueError) as e:
        merged[key] = {"missing": str(e)}
with open(dst, "w") as f:
    json.dump(merged, f, indent=1)
    f.write("\n")
PY
  fi
  [[ -f "$out/kernels.json" ]] || { [[ -s "$kb" ]] && cp "$kb" "$out/kernels.json"; }
  return 0
}

# ---- train -------------------------------------------------------------------------------------
phase_train() {
  local log="$out/train.log"
  begin_phase train
  : >"$log"
  require_gpu train "$log" || return 0
  local golden="$bundle/data/golden/llama-tiny-gqa"
  local checks="$work/checks.txt"
  : >"$checks"
  # The golden case (forward, backward, one AdamW step against PyTorch) on the GPU, under the
  # configurations ctest checks on the CPU; a tiny model: seconds each.
  local variant rc
  local -a variants=(
    "fp32|"
    "bf16|--set precision.compute=bf16"
    "fp16|--set precision.compute=fp16"
    "fused_attention|--set activation.attention=fused"
    "fused_attention_bf16|--set activation.attention=fused --set precision.compute=bf16"
    "per_layer_bf16|--set activation.strategy=per_layer --set precision.compute=bf16"
    "offload_checkpoint_bf16_mb1|--set activation.strategy=offload_checkpoint --set precision.compute=bf16 --set train.micro_batch=1"
    "optimizer_offload|--set optim.offload=cpu"
  )
  for variant in "${variants[@]}"; do
    local name="${variant%%|*}" extra
    read -r -a extra <<<"${variant#*|}"
    step train "check golden $name" 90 "$log" 0 -- \
      "$bundle/bin/shardtrain" check --model "$golden" --batch "$golden/batch.safetensors" \
      --expected "$golden/expected.safetensors" --set train.device=cuda \
      --set train.out_dir="$work/runs" "${extra[@]}"
    rc=$?
    echo "$name $rc" >>"$checks"
    # A hang would most likely hang the next variants too: leave the time to the benches.
    if ((rc == 124 || rc == 137)); then
      record SKIP train "check golden: the other variants" 0 "after the timeout of $name"
      break
    fi
  done

  # Throughput, memory and MFU. Step counts from an estimate of one step on an H100:
  #   llama-125m: 8.8e8 model FLOPs/token x 16384 tokens (micro-batch 8) = 1.4e13 per step,
  #     36 ms at 40% MFU, 0.4 s at a poor 4%: 3 warm-up + 20 measured steps per strategy.
  #   llama-1b: 8.2e9 FLOPs/token x 8192 tokens (micro-batch 4) = 6.7e13 per step, 0.17 s at
  #     40% MFU, 1.7 s at 4%: 2 warm-up + 8 measured steps per strategy (per_layer re-runs the
  #     forward: about 1.33x). Building the 1.2 B-parameter model takes seconds more per row.
  #   llama-1b-accum4: the same with 4 micro-batches per optimizer step (global batch 16, 32768
  #     tokens), as a real run accumulates: the AdamW step over 1.2 B fp32 parameters (about
  #     35 GB of memory traffic, some 12 ms) is then paid once per 4 micro-batches, not each.
  #     0.7 s per step at 40%: 1 + 4 steps, strategy none only.
  #   llama-1b-atomic-dq: llama-1b, strategy none, with the one-pass attention backward
  #     (activation.attention_backward=atomic_dq): its effect on the step beside the row above.
  # The limits below cover the 4% case with room; the built-in corpus (byte tokens) is the
  # data, since only the token ids' count matters to the speed.
  local run cfg warmup steps limit strategies extra
  local -a bench_runs=(llama-125m llama-1b llama-1b-accum4 llama-1b-atomic-dq)
  for run in "${bench_runs[@]}"; do
    extra=()
    case "$run" in
      llama-125m) cfg=llama-125m warmup=3 steps=20 limit=150 strategies=none,per_layer ;;
      llama-1b) cfg=llama-1b warmup=2 steps=8 limit=240 strategies=none,per_layer ;;
      llama-1b-accum4)
        cfg=llama-1b warmup=1 steps=4 limit=150 strategies=none
        extra=(--set train.global_batch=16)
        ;;
      llama-1b-atomic-dq)
        cfg=llama-1b warmup=2 steps=8 limit=150 strategies=none
        extra=(--set activation.attention_backward=atomic_dq)
        ;;
    esac
    step train "bench $run bf16 $strategies fused" "$limit" "$log" 1 -- \
      "$bundle/bin/shardtrain" bench --config "$bundle/configs/$cfg.yaml" \
      --set train.device=cuda --set train.seq_len=2048 --set data.path=builtin \
      --set activation.attention=fused --set train.out_dir="$work/runs" "${extra[@]}" \
      --precisions bf16 --strategies "$strategies" --warmup "$warmup" --steps "$steps" \
      --out "$work/bench-$run"
  done

  # train.csv: the bench CSVs under one header with the run's name first.
  local first=1 csv
  : >"$out/train.csv"
  for run in "${bench_runs[@]}"; do
    csv="$work/bench-$run/bench.csv"
    [[ -s "$csv" ]] || continue
    if ((first)); then
      head -n 1 "$csv" | sed 's/^/config,/' >>"$out/train.csv"
      first=0
    fi
    tail -n +2 "$csv" | sed "s/^/$run,/" >>"$out/train.csv"
  done
  [[ -s "$out/train.csv" ]] || rm -f "$out/train.csv"
  if [[ -n "$python" ]]; then
    "${py[@]}" - "$work" "$checks" "$out/train.json" "${bench_runs[@]}" <<'PY'
import json, os, sys
work, checks, dst = sys.argv[1:4]
merged = {"bench": {}, "check": []}
for cfg in sys.argv[4:]:
    path = os.path.join(work, f"bench-{cfg}", "bench.json")
    try:
        with open(path) as f:
            merged["bench"][cfg] = json.load(f)
    except (OSError, ValueError) as e:
        merged["bench"][cfg] = {"missing": str(e)}
with open(checks) as f:
    for line in f:
        name, rc = line.split()
        merged["check"].append({"variant": name, "exit_status": int(rc),
                                "passed": rc == "0"})
with open(dst, "w") as f:
    json.dump(merged, f, indent=1)
    f.write("\n")
PY
  fi
}

# ---- qlora -------------------------------------------------------------------------------------
phase_qlora() {
  local log="$out/qlora.log"
  begin_phase qlora
  : >"$log"
  require_gpu qlora "$log" || return 0
  # No released weights travel with the bundle: the base is the seeded random init, quantized to
  # NF4 as released weights would be, which costs the same per step. Building it dominates: on
  # one CPU core a 1-layer version of this model (1.3 B parameters, mostly the 128256-token
  # embedding and head) took about 80 s to initialise and quantize, so the 8 B model needs
  # minutes; one micro-batch per step (global_batch 2) keeps the measured steps short (about
  # 6e13 FLOPs each with the recomputation, well under a second at 40% MFU).
  step qlora "bench qlora-llama-3.1-8b bf16 per_layer" "$budget" "$log" 1 -- \
    "$bundle/bin/shardtrain" bench --config "$bundle/configs/qlora-llama-3.1-8b.yaml" \
    --set train.device=cuda --set data.path=builtin --set train.global_batch=2 \
    --set train.out_dir="$work/runs" --precisions bf16 --strategies per_layer \
    --warmup 1 --steps 3 --out "$work/bench-qlora"
  [[ -s "$work/bench-qlora/bench.json" ]] && cp "$work/bench-qlora/bench.json" "$out/qlora.json"
  return 0
}

# ---- cli ---------------------------------------------------------------------------------------
phase_cli() {
  local log="$out/cli.log"
  begin_phase cli
  : >"$log"
  require_gpu cli "$log" || return 0
  local cfg="$bundle/configs/tiny.yaml" t0 t1 half pid
  local -a run=("$bundle/bin/shardtrain" train --config "$cfg" --set train.device=cuda)
  # The uninterrupted run, timed, so that the stop lands half-way through the other.
  t0=$(date +%s%N)
  step cli "train tiny, uninterrupted" 120 "$log" 0 -- "${run[@]}" --set train.out_dir="$work/whole"
  t1=$(date +%s%N)
  half=$(((t1 - t0) / 2000000))  # milliseconds
  note "cli: stopping the second run after ${half} ms"
  {
    echo
    echo "===== cli: train tiny, stopped by SIGTERM after ${half} ms"
  } >>"$log"
  local start rc
  start=$(date +%s)
  # timeout passes the SIGTERM below on to the run, and ends a run that hangs after it.
  timeout --kill-after=10 120 "${run[@]}" --set train.out_dir="$work/parts" >>"$log" 2>&1 &
  pid=$!
  sleep "$(awk -v ms="$half" 'BEGIN { printf "%.3f", ms / 1000 }')"
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  rc=$?
  echo "===== exit status $rc (0: stopped after a step, with a checkpoint)" >>"$log"
  if ((rc == 0)); then
    record PASS cli "train tiny, stopped by SIGTERM half-way" $(($(date +%s) - start))
  else
    record FAIL cli "train tiny, stopped by SIGTERM half-way" $(($(date +%s) - start)) \
      "exit status $rc (see cli.log)"
  fi
  step cli "train tiny, resumed (train.resume=auto)" 120 "$log" 0 -- "${run[@]}" \
    --set train.out_dir="$work/parts" --set train.resume=auto
  # It must have continued from the stop's checkpoint, not started over.
  if grep -q "resumed from .*step-" "$log"; then
    grep -o "resumed from .*" "$log" | tail -n 1 | tee -a "$summary"
  else
    record FAIL cli "the second run resumed from a checkpoint" 0 "no 'resumed from' in cli.log"
  fi
  if [[ -n "$python" ]]; then
    step cli "resumed losses equal the uninterrupted run's, bit for bit" 30 "$log" 1 -- \
      "${py[@]}" - "$work/whole/metrics.jsonl" "$work/parts/metrics.jsonl" "$out/cli.json" <<'PY'
import json, sys
whole_path, parts_path, dst = sys.argv[1:4]
def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step":
                out[e["step"]] = e["loss"]
    return out
whole, parts = losses(whole_path), losses(parts_path)
with open(dst, "w") as f:
    json.dump({"uninterrupted": whole, "stopped_and_resumed": parts}, f)
differ = [s for s in whole if parts.get(s) != whole[s]]
print(f"{len(whole)} steps uninterrupted, {len(parts)} in the stopped-and-resumed run; "
      f"{len(differ)} differ" + (f" (first: step {differ[0]})" if differ else ""))
sys.exit(0 if whole and not differ and len(parts) == len(whole) else 1)
PY
  else
    record FAIL cli "resumed losses equal the uninterrupted run's" 0 "no python3 here"
  fi
  step cli "train qlora-tiny" 120 "$log" 0 -- "$bundle/bin/shardtrain" train \
    --config "$bundle/configs/qlora-tiny.yaml" --set train.device=cuda \
    --set train.out_dir="$work/qlora"
  if [[ -f "$work/qlora/adapter/adapter_model.safetensors" ]]; then
    echo "qlora adapter: $(ls -l "$work/qlora/adapter" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' ')" \
      | tee -a "$log"
  else
    record FAIL cli "qlora-tiny wrote its PEFT adapter" 0 "no $work/qlora/adapter/adapter_model.safetensors"
  fi
  return 0
}

# ---- profile -----------------------------------------------------------------------------------
phase_profile() {
  local log="$out/profile.txt"
  begin_phase profile
  : >"$log"
  require_gpu profile "$log" || return 0
  local ncu
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)"
  if [[ -z "$ncu" ]]; then
    record FAIL profile "ncu" 0 "Nsight Compute (ncu) is not installed here"
    return 0
  fi
  # One launch of each kernel per shape (--iters 1 --warmup 0): 3 kernels x 6 shapes. ncu fixes
  # the SM clock while it measures, so its durations are longer than the kernel bench's.
  step profile "ncu: fused attention kernels" 300 "$log" 0 -- "$ncu" --kernel-name-base demangled \
    --kernel-name regex:"flash_(forward|backward)" --launch-count 18 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    "$bundle/bin/shardtrain-kernel-bench" --only attention --iters 1 --warmup 0
  grep -E "flash_|Duration|Issue Slots Busy|Achieved Occupancy|highest-utilized" "$log" | head -n 80
  return 0
}

# ---- main --------------------------------------------------------------------------------------
summary_before=0
[[ -f "$summary" ]] && summary_before=$(wc -l <"$summary")
{
  echo "gpu-verify $phase_arg: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); bundle $bundle"
  [[ -f "$bundle/VERSION" ]] && sed 's/^/  bundle: /' "$bundle/VERSION"
  if gpu_present; then nvidia-smi -L 2>&1 | sed 's/^/  /'; else echo "  no CUDA device"; fi
} >>"$summary"
case "$phase_arg" in
  tests) phase_tests ;;
  kernels) phase_kernels ;;
  train) phase_train ;;
  qlora) phase_qlora ;;
  cli) phase_cli ;;
  profile) phase_profile ;;
  all)
    shared_budget=1
    phase_tests
    phase_kernels
    phase_train
    ;;
esac

echo >&2
tail -n +$((summary_before + 1)) "$summary" >&2
note "$failures step(s) did not pass; files in $out: $(cd "$out" && ls | tr '\n' ' ')"
((failures == 0))
