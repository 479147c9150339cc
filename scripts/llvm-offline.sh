#!/usr/bin/env bash
# usage: scripts/llvm-offline.sh [PREFIX_PARENT]    then: export XDG_DATA_HOME=<printed path>
#
# CubeCL 0.12's CUDA runtime links LLVM through `tracel-llvm-bundler`, whose build script
# downloads a prebuilt LLVM 23.1 unless it finds one installed under
# `$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/`. Where the build cannot reach that download
# (only package registries), this script puts Debian's LLVM 22 there instead: it installs the
# packages, writes the bundler's sentinel and an `llvm-config` wrapper that fixes up what
# Debian's lists, and prints the XDG_DATA_HOME that cargo must see (the repository's
# `.cargo/config.toml` already points cargo at the default one). Only the CUDA build (feature
# `cuda`) needs it; a wgpu-only build pulls no LLVM. Idempotent, and it leaves an LLVM that the
# bundler downloaded there alone.
#
# PREFIX_PARENT defaults to `.llvm-offline/` at the repository root (git-ignored).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
data_home="${1:-$root/.llvm-offline}"
prefix="$data_home/tracel/tracel-llvm-23.1.0-4"
# An LLVM the bundler downloaded (its own llvm-config, not this script's wrapper): nothing to do.
if [ -e "$prefix/.tracel-llvm-installed" ] && [ -x "$prefix/bin/llvm-config" ] \
  && ! grep -q llvm-22 "$prefix/bin/llvm-config" 2>/dev/null; then
  echo "$data_home"
  exit 0
fi
packages=(llvm-22-dev libzstd-dev libxml2-dev zlib1g-dev libz3-dev)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    "${missing[@]}" >&2
fi

mkdir -p "$prefix/bin"
# Files written only when missing or different: a new modification time would make cargo
# rebuild the bundler and every crate above it (cubecl-cuda, burn-cuda, ...).
[ -e "$prefix/.tracel-llvm-installed" ] || touch "$prefix/.tracel-llvm-installed"
# Debian lists Polly, which it does not package, among the libraries, and gives libz3 as a full
# path the bundler cannot turn into a link flag.
wrapper=$(mktemp)
cat >"$wrapper" <<'WRAPPER'
#!/usr/bin/env bash
set -o pipefail
/usr/lib/llvm-22/bin/llvm-config "$@" |
  sed -e 's/ *-lPollyISL//g' -e 's/ *-lPolly//g' -e 's#/usr/lib/x86_64-linux-gnu/libz3\.so#-lz3#g'
WRAPPER
if cmp -s "$wrapper" "$prefix/bin/llvm-config"; then
  rm -f "$wrapper"
else
  chmod +x "$wrapper" && mv "$wrapper" "$prefix/bin/llvm-config"
fi
"$prefix/bin/llvm-config" --version >/dev/null
echo "$data_home"
