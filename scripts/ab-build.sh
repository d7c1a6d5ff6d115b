#!/usr/bin/env bash
# Builds the release `nibble` of each given revision for an A/B on the GPU machine and packs
# what a device call carries. Run on the development machine:
#   scripts/ab-build.sh 6001027 091d154 HEAD
# writes target/ab/nibble-1-6001027, target/ab/nibble-2-091d154, ... (the number keeps the
# order in which scripts/gpu-bench.sh's `ab` step runs them) and target/pack.tgz (target/ab,
# the tokenizer, scripts/gpu-bench.sh, .commit). On the GPU machine: `tar xzf target/pack.tgz`,
# then `NIBBLE_BIN=target/ab/nibble-2-... scripts/gpu-bench.sh synth,ab` (see that step).
# Each revision builds in a worktree under /tmp with one shared target folder, so only the
# workspace's own crates are rebuilt from one revision to the next.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 REV [REV...]" >&2; exit 2; }
[ -s vendor/qwen3-tokenizer/tokenizer.json ] || scripts/fetch-tokenizer.sh
ROOT=$(pwd)
rm -rf target/ab
mkdir -p target/ab
i=0
for rev in "$@"; do
  i=$((i + 1))
  short=$(git rev-parse --short "$rev")
  wt=/tmp/nibble-ab-$short
  git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
  git worktree add --detach "$wt" "$short" > /dev/null
  (cd "$wt" && CARGO_TARGET_DIR="$ROOT/target/ab-build" cargo build --release -q -p nibble-cli)
  cp target/ab-build/release/nibble "target/ab/nibble-$i-$short"
  git worktree remove --force "$wt"
  echo "target/ab/nibble-$i-$short"
done
git rev-parse --short HEAD > .commit
tar czf target/pack.tgz target/ab vendor/qwen3-tokenizer scripts/gpu-bench.sh .commit
ls -l target/pack.tgz
