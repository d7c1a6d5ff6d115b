#!/usr/bin/env bash
# One device call of session 7 (kept so it can be repeated): kernel rows at pos 128 (attention
# fused vs dispatch at 1/128/512/4096, MoE "(as plan)" rows), then parity and the whole-token
# A/B of the attention combine. Usage on the GPU machine: OUT=/dir scripts/gpu-call-combine.sh
set -uo pipefail
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp
KB=target/release/examples/kernel_bench
timeout 120 $KB --shapes full --pos 128 --reps 2 > /dev/null 2>&1
timeout 150 $KB --shapes full --pos 128 2>&1 | grep -v XDG_RUNTIME > "$OUT/kernels.txt"
scripts/gpu-bench.sh "${STEPS:-synth,parity,combineab}"
