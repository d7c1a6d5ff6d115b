#!/usr/bin/env bash
# One device call (session 16): the cooperative-matrix probes and the GEMM/prefill tests on the
# NVIDIA adapter (the matrix-unit kernel is chosen there), then, where they pass, parity and the
# matrix-unit vs f32 GEMM A/B on the full model. Usage on the GPU machine: OUT=/dir scripts/coop-debug.sh
set -uo pipefail
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp
T=target/release/gpu-tests
NIBBLE_TEST_ADAPTER=nvidia timeout 60 $T coop_probe onehot --ignored --nocapture --test-threads 1 2>&1 | grep -E "coop_probe|onehot_probe tm|test result" | cut -c1-200 | tee $OUT/probe.txt
NIBBLE_TEST_ADAPTER=nvidia timeout 150 $T gemm prefill --test-threads 1 > $OUT/tests.txt 2>&1
echo "tests: $(grep -c '\.\.\. ok' $OUT/tests.txt) ok, $(grep -c FAILED $OUT/tests.txt) FAILED"
grep -E "got|panicked" $OUT/tests.txt | head -6
grep -q FAILED $OUT/tests.txt && exit 4
COOP_QUICK=${COOP_QUICK:-0} CLOCKS=0 PREFILL_PROF="512" scripts/gpu-bench.sh ${STEPS:-synth,parity,coop,prefillprof}
