#!/usr/bin/env bash
# Set up everything vla-rl needs on a fresh Debian 12 machine, idempotently:
#   1. system packages the simulators need (Vulkan CPU driver from bookworm-backports, OSMesa/EGL, ffmpeg)
#   2. a Python 3.12 virtual environment with the locked dependency set (requirements/lock.txt)
#   3. vla-rl itself and its robot-side package (packages/vla-rl-client), installed editable into it
# The environment lives outside the clone, keyed by the lock file's hash, and `.venv` links to it,
# so a fresh clone (CI) with an unchanged lock file is ready in seconds.
#
# Environment knobs:
#   VLA_RL_VENV_ROOT   where keyed environments live   (default: ~/.cache/vla-rl/venvs)
#   VLA_RL_PYTHON      Python 3.12 interpreter to use  (default: found through pyenv or PATH)
#   VLA_RL_SKIP_APT=1  skip system packages (e.g. inside a prepared image)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
log() { printf '[setup] %s\n' "$*" >&2; }

# pip on these machines warns about every package missing from the extra local indexes in pip.conf.
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# ---------------------------------------------------------------- system packages
# postgresql: the server the metadata DB tests start a throwaway cluster of (tests/pg_cluster.py)
# chromium: the headless browser the dashboard's tests drive through playwright (never 'playwright install')
apt_packages=(libvulkan1 libosmesa6 libegl1 libgl1 libglvnd0 ffmpeg postgresql chromium)
need_mesa_major=24   # SAPIEN needs descriptorBindingPartiallyBound: bookworm's Mesa 22.3 lacks it

mesa_ok() {
  local v
  v=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
  [ -n "$v" ] && [ "${v%%.*}" -ge "$need_mesa_major" ] 2>/dev/null
}

apt_missing() {
  local p missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

add_backports_source() {
  # Reuse the mirror the machine already uses for bookworm; never hard-code a host.
  local src=/etc/apt/sources.list.d/vla-rl-backports.sources uri=""
  [ -f "$src" ] && return 0
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/{u=$2} /^Suites:/{ if ($0 ~ /bookworm( |$)/) {print u; exit} }' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $3=="bookworm" {print $2; exit}' /etc/apt/sources.list)
  fi
  if [ -z "$uri" ]; then
    log "could not find the Debian mirror for bookworm in /etc/apt; add bookworm-backports by hand"
    return 1
  fi
  log "adding bookworm-backports from $uri"
  as_root tee "$src" >/dev/null <<SRC
Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
}

setup_system() {
  if [ "${VLA_RL_SKIP_APT:-0}" = 1 ]; then log "skipping system packages (VLA_RL_SKIP_APT=1)"; return; fi
  if ! command -v apt-get >/dev/null; then log "no apt-get: install a Vulkan CPU driver (Mesa >= $need_mesa_major), OSMesa, EGL and ffmpeg yourself"; return; fi
  local missing; missing=$(apt_missing)
  if mesa_ok && [ -z "$missing" ]; then log "system packages present"; return; fi
  export DEBIAN_FRONTEND=noninteractive
  if ! mesa_ok; then
    add_backports_source
    as_root apt-get update -qq
    as_root apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    as_root apt-get update -qq
  fi
  missing=$(apt_missing)
  # shellcheck disable=SC2086
  [ -z "$missing" ] || as_root apt-get install -y -qq $missing >/dev/null
  log "system packages installed"
}

# ---------------------------------------------------------------- python
find_python() {
  if [ -n "${VLA_RL_PYTHON:-}" ]; then echo "$VLA_RL_PYTHON"; return; fi
  local c
  for c in python3.12 "$(command -v pyenv >/dev/null && pyenv root)/versions/"3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$(command -v "$c" 2>/dev/null || echo "$c")" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$c" 2>/dev/null || echo "$c"; return
    fi
  done
  return 1
}

setup_python() {
  local py key root venv
  py=$(find_python) || { log "Python 3.12 not found (lerobot 0.6 and zarr 3.4 need it): install it (e.g. 'pyenv install 3.12') or set VLA_RL_PYTHON"; exit 1; }
  key=$( (cat requirements/lock.txt requirements/no-deps.txt; "$py" -VV) | sha256sum | cut -c1-16)
  root="${VLA_RL_VENV_ROOT:-$HOME/.cache/vla-rl/venvs}"
  venv="$root/$key"
  if [ ! -f "$venv/.complete" ]; then
    log "creating environment $venv with $py (first time: ~4 min, ~8 GB)"
    rm -rf "$venv"; mkdir -p "$root"
    "$py" -m venv "$venv"
    quiet_pip "$venv/bin/python" -m pip install -q pip==26.3 setuptools==81.0.0 wheel==0.48.0
    # robosuite's own dependency list pulls mink, which downgrades numpy below 2 and breaks
    # lerobot and zarr: its real needs are in the lock file, robosuite itself goes in without deps.
    quiet_pip "$venv/bin/python" -m pip install -q -r requirements/lock.txt
    quiet_pip "$venv/bin/python" -m pip install -q --no-deps -r requirements/no-deps.txt
    touch "$venv/.complete"
  else
    log "environment $venv is ready"
  fi
  if [ -e .venv ] && [ ! -L .venv ]; then
    log ".venv exists and is not our link; leaving it (set it aside to use the keyed environment)"
  else
    ln -sfn "$venv" .venv
  fi
  # the robot-side package first (vla-rl depends on it), then vla-rl itself; both editable
  quiet_pip .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e packages/vla-rl-client -e . >&2
  .venv/bin/python -c 'import vla_rl, vla_rl_client' || { log "vla_rl or vla_rl_client failed to import"; exit 1; }
}

setup_system
setup_python
log "done: use .venv/bin/vla-rl (or 'source .venv/bin/activate')"
