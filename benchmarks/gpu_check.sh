#!/usr/bin/env bash
# One lease of a GPU machine (the `device` tool), in one call: the engine bench on CUDA at 1/16/64/256
# streams (bf16, SmolLM2-135M's shape), the CUDA tests, and a translator training run
# (configs/translate_gpu.json, time-boxed by its max_hours) that runs beside the tests.
# The whole call keeps inside GPU_CHECK_SECONDS (default 540: a lease's call may run 600 s): bench points
# that would eat into the training's share are skipped, and the training is stopped (SIGTERM: its state
# saved) in time to average its snapshots and export them.
# Needs: torch with CUDA, pytest, sentencepiece, safetensors, sacrebleu (the machine's own Python), the
# prepared corpus as data/translate.tgz (ignored by git; carry it with the call), made by
#   attnserve data prepare translate && mkdir -p data && tar czf data/translate.tgz -C \
#     ~/.cache/attnserve/data/translate train.tsv train.source dev.tsv ted_dev.tsv test.tsv ted_test.tsv
# Writes everything under $OUT (logs; the exported weights in pieces under 16 MiB: `cat model.part* >`).
# Env: GPU_CHECK_DEVICE (default cuda), GPU_CHECK_SECONDS and GPU_CHECK_TRAIN_SECONDS (the budgets above),
# GPU_CHECK_TINY=1 validates the script on a CPU in two or three minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
DEV=${GPU_CHECK_DEVICE:-cuda}
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 ATTNSERVE_PROGRESS=lines ATTNSERVE_HOME=${ATTNSERVE_HOME:-/tmp/attnserve_home}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

log "host: $(nproc) CPUs; $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

DATA=$ATTNSERVE_HOME/data/translate
mkdir -p "$DATA" && tar xzf data/translate.tgz -C "$DATA" || { log "no data/translate.tgz"; exit 2; }
RUN=$ATTNSERVE_HOME/runs/translate_gpu
CFG=configs/translate_gpu.json
USERS="1 16 64 256"
TINY=()
BUDGET=540 TRAIN_SHARE=360  # the bench stops where less than TRAIN_SHARE seconds would be left
if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
  $PY - <<'PY'
import json; c = json.load(open("configs/translate_gpu.json"))
c["model"].update(d_model=32, n_encoder_layers=1, n_decoder_layers=1, n_heads=2, d_ff=64)
c.update(max_hours=0.005, batch_tokens=4000, threads=1, ckpt_minutes=0.05)
json.dump(c, open("/tmp/translate_gpu_tiny.json", "w"))
PY
  CFG=/tmp/translate_gpu_tiny.json
  RUN=$ATTNSERVE_HOME/runs/translate_gpu_tiny  # never resumed by a full run
  USERS="1 4"
  TINY=(--tiny)
  BUDGET=150 TRAIN_SHARE=60
fi
BUDGET=${GPU_CHECK_SECONDS:-$BUDGET} TRAIN_SHARE=${GPU_CHECK_TRAIN_SECONDS:-$TRAIN_SHARE}
EXPORT_SECONDS=60  # averaging and exporting the snapshots, packing $OUT
left() { echo $(( BUDGET - SECONDS )); }  # bash's SECONDS counts from the script's start
mkdir -p "$RUN" && cp weights/attnserve-zh-en/tokenizer.model "$RUN/spm.model"  # the shipped 8k vocabulary

# 1. the engine bench first, with the GPU to itself
for n in $USERS; do
  req=$(( n < 2 ? 4 : 2 * n ))
  room=$(( $(left) - TRAIN_SHARE ))
  if [ "$room" -lt 30 ]; then log "bench_engine: $n streams and up skipped (budget)"; break; fi
  log "bench_engine: $n streams"
  timeout $(( room < 150 ? room : 150 )) $PY -m benchmarks.bench_engine --device "$DEV" --dtype bfloat16 --modes continuous --clients "$n" \
    --requests "$req" --prompt 64 64 --output 128 128 --threads 4 "${TINY[@]}" \
    2>>"$OUT/bench.err" | tee -a "$OUT/bench.md"
done

# 2. training in the background, the tests beside it
TRAIN_ARGS=(translate --config "$CFG" --run-dir "$RUN" --device "$DEV" --export-to "$OUT/export")
log "training $CFG on $DEV, at most $(( $(left) - EXPORT_SECONDS )) s"
timeout -s TERM -k 30 $(( $(left) - EXPORT_SECONDS )) $PY -m service.cli train "${TRAIN_ARGS[@]}" --resume \
  > "$OUT/train.out" 2>&1 &
TRAIN=$!
log "pytest tests/test_cuda.py"
t=$(( $(left) - EXPORT_SECONDS )); timeout $(( t < 200 ? t : 200 )) $PY -m pytest -q -ra -p no:cacheprovider \
  tests/test_cuda.py 2>&1 | tail -25 | tee -a "$OUT/summary.txt"
wait $TRAIN; rc=$?; log "training exit $rc"
if [ ! -f "$OUT/export/model.safetensors" ]; then  # stopped by the budget (rc 124): export what it saved
  log "exporting the run's snapshots"
  $PY -m service.cli train "${TRAIN_ARGS[@]}" --export-only >> "$OUT/train.out" 2>&1; log "export exit $?"
fi
cp "$RUN/train.log" "$OUT/train.log" 2>/dev/null
grep -v '"step": [0-9]*, "epoch"' "$OUT/train.log" | cut -c1-300 | tail -5 | tee -a "$OUT/summary.txt"
tail -3 "$OUT/train.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
if [ -f "$OUT/export/model.safetensors" ]; then
  (cd "$OUT/export" && split -b 15M -d model.safetensors model.part && rm model.safetensors)
  mv "$OUT"/export/* "$OUT"/ && rmdir "$OUT/export"
fi
rm -f "$OUT/tokenizer.model"  # the shipped one (the run's vocabulary)
(cd "$OUT" && tar czf logs.tgz --remove-files bench.err train.out train.log config.json 2>/dev/null)
ls -la "$OUT" | tee -a "$OUT/summary.txt"  # at most 8 files come back
