#!/usr/bin/env bash
# The whole test suite: installs its prerequisites, then runs every test of every crate.
# GPU tests run on whatever Vulkan adapter exists (lavapipe in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NIBBLE_TOKENIZER_DIR="${NIBBLE_TOKENIZER_DIR:-$PWD/vendor/qwen3-tokenizer}"
cargo fmt --all -- --check
cargo test --workspace "$@"
