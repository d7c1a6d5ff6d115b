#!/usr/bin/env bash
# One device call for an A/B (session 7; kept so it can be repeated): kernel_bench rows at pos
# 128 (attention at 1/128/512/4096, MoE "(as plan)" rows) for every target/ab/kb-* build (or
# the release kernel_bench when none is carried), then scripts/gpu-bench.sh $STEPS (default
# synth,parity,combineab; e.g. STEPS=synth,ab with AB_ARGS to compare target/ab/nibble-*).
# Usage on the GPU machine: OUT=/dir scripts/gpu-call-ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp
KBS=$(ls target/ab/kb-* 2>/dev/null || echo target/release/examples/kernel_bench)
FIRST=1
for kb in $KBS; do
  # The first invocation on an idle GPU runs at low clocks: a discarded warm-up first.
  [ $FIRST = 1 ] && timeout 120 $kb --shapes full --pos 128 --reps 2 > /dev/null 2>&1
  FIRST=0
  timeout 150 $kb --shapes full --pos 128 2>&1 | grep -v XDG_RUNTIME > "$OUT/kernels-$(basename $kb).txt"
done
scripts/gpu-bench.sh "${STEPS:-synth,parity,combineab}"
