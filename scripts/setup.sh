#!/usr/bin/env bash
# What a fresh Debian or Ubuntu machine needs before README's two commands, installed only when
# missing (idempotent; apt-get through sudo when not root):
#
# - lavapipe (Mesa's Vulkan driver on the CPU) and the Vulkan loader, for the wgpu path on a
#   machine without a GPU;
# - LLVM for the CUDA build (`--features cuda`): CubeCL 0.12's CUDA runtime links it, and its
#   build downloads one; where the build cannot reach that download, scripts/llvm-offline.sh
#   installs Debian's in its place (an LLVM the build already downloaded is left alone).
#
# Elsewhere (no dpkg) it does nothing: the build downloads LLVM, and wgpu uses the GPU's own
# Vulkan, Metal or DX12 driver.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dpkg-query >/dev/null; then
  echo "setup.sh: not a Debian-like system, nothing installed" >&2
  exit 0
fi
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if ! installed mesa-vulkan-drivers || ! installed libvulkan1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    mesa-vulkan-drivers libvulkan1
fi
scripts/llvm-offline.sh >/dev/null
