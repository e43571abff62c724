#!/usr/bin/env bash
# Download wheels for Python packages the GPU machine lacks into experiments/wheels/, here on the
# CPU machine (which reaches PyPI; the GPU machine reaches nothing). device_collect.sh installs
# them there with `pip install --no-index`.
#
#   bash experiments/fetch_device_wheels.sh [NAME[==VERSION] ...]
#
# Default names: the harness's small runtime dependencies. The nvidia-h200 image already has
# torch, transformers, peft, pandas, pyarrow, typer, rich and nvidia-ml-py (device KINDS.md), so
# pass just what device_collect.sh reported missing. `--no-deps`: name every missing dependency.
# The folder is excluded from git locally (.git/info/exclude) and must be carried by the device
# tool: run(..., carry=["experiments/wheels"]). The whole carried tree is capped at 64 MiB
# (pyarrow alone is ~40 MiB; bitsandbytes is larger than the cap).
# PY_VERSION: the GPU machine's Python (3.12 on the nvidia-h200 image).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
DEST=experiments/wheels
if [ $# -gt 0 ]; then pkgs=("$@"); else pkgs=(nvidia-ml-py typer rich peft); fi

mkdir -p "$DEST"
grep -qx '/experiments/wheels/' .git/info/exclude 2>/dev/null \
  || echo '/experiments/wheels/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp "${platforms[@]}" -d "$DEST" "${pkgs[@]}"
size=$(du -sm "$DEST" | cut -f1)
echo "experiments/wheels: ${size} MiB"
ls -1 "$DEST"
if [ "$size" -gt 60 ]; then
  echo "warning: over ~60 MiB; the device tool carries at most 64 MiB in all" >&2
fi
