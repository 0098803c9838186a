#!/usr/bin/env bash
# Set up everything vla-rl needs on a fresh Debian 12 machine, idempotently:
#   1. system packages the simulators need (Vulkan CPU driver from bookworm-backports, OSMesa/EGL, ffmpeg)
#   2. a Python 3.12 virtual environment with the locked dependency set (requirements/lock.txt)
#   3. this checkout's own environment, .venv: a small venv layered on the shared one (a .pth adds the
#      shared site-packages after its own), with vla-rl and its robot-side package (packages/vla-rl-client)
#      installed editable into it
# The dependencies live outside the clone, keyed by the lock file's hash, and are shared by every checkout
# on the machine, so a fresh clone (CI) with an unchanged lock file is ready in seconds. vla-rl itself is
# never installed into the shared environment: there the last checkout that ran setup won, and `vla-rl`
# in every other checkout (and every process its tests start) ran that checkout's code.
#
# Environment knobs:
#   VLA_RL_VENV_ROOT   where keyed environments live   (default: ~/.cache/vla-rl/venvs)
#   VLA_RL_PYTHON      Python 3.12 interpreter to use  (default: found through pyenv or PATH)
#   VLA_RL_SKIP_APT=1  skip system packages (e.g. inside a prepared image)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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

# The shared environment's key: the locked dependency set and the exact interpreter.
env_key() { (cat "$repo/requirements/lock.txt" "$repo/requirements/no-deps.txt"; "$1" -VV) | sha256sum | cut -c1-16; }

setup_python() {
  local py key root venv
  py=$(find_python) || { log "Python 3.12 not found (lerobot 0.6 and zarr 3.4 need it): install it (e.g. 'pyenv install 3.12') or set VLA_RL_PYTHON"; exit 1; }
  key=$(env_key "$py")
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
  layer_checkout "$py" "$venv"
  # the robot-side package first (vla-rl depends on it), then vla-rl itself; both editable, into this
  # checkout's .venv only (pip finds the shared environment's pip and setuptools through the layer)
  quiet_pip .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e packages/vla-rl-client -e . >&2
  .venv/bin/python -c 'import vla_rl, vla_rl_client' || { log "vla_rl or vla_rl_client failed to import"; exit 1; }
}

# .venv: this checkout's venv (its own interpreter links, scripts and editable installs, a few kB) with
# the shared environment's site-packages added after its own by a .pth. Remade only when the shared
# environment changes (a new lock); a link left by an older setup is replaced, a .venv of someone
# else's is left alone (and used as it is).
layer_checkout() {
  local py=$1 deps=$2 marker=.venv/.vla-rl-deps site deps_site
  if [ -L .venv ]; then
    rm .venv
  elif [ -e .venv ] && [ ! -f "$marker" ]; then
    log ".venv exists and is not ours; using it as it is (set it aside to use the shared environment)"
    return
  fi
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$deps" ] && [ -x .venv/bin/python ]; then
    return
  fi
  log "layering .venv on $deps"
  rm -rf .venv
  "$py" -m venv --without-pip .venv
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  deps_site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cat >"$site/_vla_rl_deps.py" <<PY
"""This checkout's .venv on top of the shared dependency environment (written by scripts/setup.sh).

The shared site-packages goes after this venv's own, and its .pth files are processed, except the
editable vla-rl / vla-rl-client an older setup may have left there: that is another checkout's code."""

import os
import site
import sys

DEPS = "$deps_site"


def _layer() -> None:
    if DEPS in sys.path:
        return
    sys.path.append(DEPS)
    for name in sorted(os.listdir(DEPS)):
        if name.endswith(".pth") and not name.startswith("__editable__.vla_rl"):
            site.addpackage(DEPS, name, set())


_layer()
PY
  echo "import _vla_rl_deps" >"$site/_vla_rl_deps.pth"
  echo "$deps" >"$marker"
}

main() {
  cd "$repo"
  setup_system
  setup_python
  log "done: use .venv/bin/vla-rl (or 'source .venv/bin/activate')"
}

# Sourced (tests: env_key), it only defines the functions.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
