#!/usr/bin/env bash
# Measure a sweep on a bare GPU machine (the device tool's nvidia-h200) and write what comes
# back to $OUT: the parquet dataset, the log, and measured-vs-analytic spread.
#
# Run from the repo root on the GPU machine, e.g. through the device tool:
#   bash experiments/device_collect.sh              (timeout_s 600; carry ["experiments/wheels"]
#                                                    only if a dependency is missing there)
# Environment (all optional except OUT, which the device tool sets):
#   SWEEP=datasets/sweeps/h200-first.toml  MAX_MINUTES=7  PY=python3  RECORD_HISTORY=1
#   DRY_RUN=1: no GPU needed; the CPU stand-in probe runs the whole path (to check this script)
# Exit codes: 0 ok; 3 no CUDA; 4 a dependency is missing and no wheel was carried;
# otherwise the collect command's own code. Nothing here fails silently: every step logs.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
PY=${PY:-python3}
SWEEP=${SWEEP:-datasets/sweeps/h200-first.toml}
MAX_MINUTES=${MAX_MINUTES:-7}  # the sweep says 8; 7 leaves the 10-minute call room to finish
export PYTHONUNBUFFERED=1
export HYBRIDMEM_CACHE=/tmp/hybridmem-cache  # materialised model configs
log() { echo "[device_collect $(date -u +%H:%M:%S)] $*"; }

mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_collect.log") 2>&1
log "host $(hostname); sweep $SWEEP; budget ${MAX_MINUTES} min"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv \
  || log "nvidia-smi failed (continuing: torch decides)"

# 1. CUDA through torch, or stop with exit 3
if [ "${DRY_RUN:-0}" = 1 ]; then
  export HYBRIDMEM_PROBE=hybridmem.harness.probe:CpuProbe
  log "DRY_RUN: CPU stand-in probe, rows are source=dryrun, nothing is measured"
elif ! $PY - <<'PYEOF'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda available:", torch.cuda.is_available())
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
then
  log "torch sees no CUDA device: nothing measured"; exit 3
fi

# 2. Dependencies: the harness needs these modules; install carried wheels for missing ones
missing=$($PY - <<'PYEOF'
import importlib.util
need = {"transformers": "transformers", "peft": "peft", "pandas": "pandas", "pyarrow": "pyarrow",
        "typer": "typer", "rich": "rich", "numpy": "numpy", "pynvml": "nvidia-ml-py"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  log "missing on this machine: $missing"
  if ls experiments/wheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/hybridmem-site experiments/wheels/*.whl || { log "wheel install failed"; exit 4; }
    export PYTHONPATH=/tmp/hybridmem-site${PYTHONPATH:+:$PYTHONPATH}
  else
    log "no wheels carried: run 'bash experiments/fetch_device_wheels.sh $missing' on the CPU"
    log "machine and pass carry=[\"experiments/wheels\"]"; exit 4
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import hybridmem, transformers, peft, pandas; print('hybridmem from', hybridmem.__file__, \
'| transformers', transformers.__version__, '| peft', peft.__version__, '| pandas', pandas.__version__)" \
  || { log "hybridmem does not import"; exit 4; }
$PY -c "import bitsandbytes" 2>/dev/null \
  || log "bitsandbytes absent: quantize / 8-bit / paged / lion-32bit rows will be 'error'"
$PY -c "import liger_kernel" 2>/dev/null || log "liger-kernel absent: liger rows will be 'error'"

# 3. Collect (TERM 3 minutes past the budget, which also kills the config in flight, then KILL:
#    the call always ends with files)
args=(--sweep "$SWEEP" --backend cuda --out "$OUT/dataset" --max-minutes "$MAX_MINUTES")
[ "${RECORD_HISTORY:-0}" = 1 ] && args+=(--record-history)
start=$(date +%s)
timeout -k 30 $(( MAX_MINUTES * 60 + 180 )) $PY -m hybridmem.harness "${args[@]}"
rc=$?
log "collect exited $rc after $(( $(date +%s) - start )) s"

# 4. Pack what comes back: one parquet file (compact again in case collect was killed),
#    error logs and histories as archives (the device tool returns at most 8 files)
$PY -c "from hybridmem.harness import compact; compact('$OUT/dataset')" || log "compaction failed"
find "$OUT/dataset" -name '.*.tmp' -delete 2>/dev/null  # a killed writer's unfinished part
for sub in logs history; do
  if [ -d "$OUT/dataset/$sub" ]; then
    tar czf "$OUT/$sub.tgz" -C "$OUT/dataset" "$sub" && rm -rf "${OUT:?}/dataset/$sub"
  fi
done

# 5. The numbers for the note: rows, outcomes, measured - analytic spread
$PY - "$OUT/dataset" <<'PYEOF' || log "summary failed"
import sys
from hybridmem.harness import load_dataset
df = load_dataset(sys.argv[1])
print("rows", len(df), "| outcomes", df["outcome"].value_counts().to_dict(),
      "| measuring time s", round(float(df["wall_seconds"].sum()), 1))
print(df[["model_name", "micro_batch", "seq_len", "precision", "train", "outcome",
          "peak_allocated_bytes", "peak_device_bytes", "wall_seconds"]].to_string())
PYEOF
source=cuda; [ "${DRY_RUN:-0}" = 1 ] && source=dryrun
$PY -m hybridmem.harness.compare "$OUT/dataset" --method analytic --source $source \
  --csv "$OUT/compare-analytic.csv" > "$OUT/spread-analytic.json" || log "comparison failed"
cat "$OUT/spread-analytic.json"
ls -la "$OUT" "$OUT/dataset"
exit $rc
