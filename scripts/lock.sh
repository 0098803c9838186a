#!/usr/bin/env bash
# Regenerate requirements/lock.txt: the exact dependency set, resolved by pip on CPython 3.12 / Linux x86_64
# and written as `pip freeze` prints it (the lock's header says so; scripts/setup.sh installs it).
#
#   scripts/lock.sh                   resolve pyproject.toml's dependencies + the dev extra afresh in a
#                                     throwaway venv (needs the package index; minutes, ~8 GB) and freeze it
#   scripts/lock.sh --from-venv DIR   freeze an existing venv instead (no network), e.g. after adding a pin
#   --out FILE                        write there instead of requirements/lock.txt
#
# What it leaves out: vla-rl and vla-rl-client themselves (installed editable by setup.sh) and every package of
# requirements/no-deps.txt (robosuite: installed with --no-deps, its real needs are in pyproject.toml).
# Knobs: VLA_RL_PYTHON (the Python 3.12 interpreter, as setup.sh), PIP_INDEX_URL etc. as pip reads them.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
log() { printf '[lock] %s\n' "$*" >&2; }
die() { printf 'lock.sh: %s\n' "$*" >&2; exit 2; }

from_venv="" out="requirements/lock.txt"
while [ $# -gt 0 ]; do
  case "$1" in
    --from-venv) [ $# -ge 2 ] || die "--from-venv: expected a venv directory"; from_venv="$2"; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out: expected a file path"; out="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (expected --from-venv DIR, --out FILE)" ;;
  esac
done

# the same pins of the installer itself as setup.sh (pip, setuptools, wheel)
bootstrap=$(grep -o 'pip==[^ ]* setuptools==[^ ]* wheel==[^ ]*' scripts/setup.sh) \
  || die "scripts/setup.sh: no 'pip==... setuptools==... wheel==...' line to pin the installer from"

if [ -n "$from_venv" ]; then
  py="$from_venv/bin/python"
  [ -x "$py" ] || die "--from-venv: $from_venv/bin/python is not an interpreter"
else
  base_py="${VLA_RL_PYTHON:-$(command -v python3.12 || true)}"
  [ -n "$base_py" ] || die "VLA_RL_PYTHON: no python3.12 on PATH; set VLA_RL_PYTHON to a Python 3.12"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  log "resolving pyproject.toml (+ dev) in a throwaway venv $tmp/venv"
  "$base_py" -m venv "$tmp/venv"
  py="$tmp/venv/bin/python"
  # shellcheck disable=SC2086
  "$py" -m pip install -q $bootstrap
  "$py" -m pip install -q -e packages/vla-rl-client -e ".[dev]"
fi
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || die "the venv's Python is not 3.12 (the lock is for CPython 3.12)"

# names (normalised as PEP 503) of the no-deps packages, which the lock must not pin
skip=$(grep -v '^\s*#' requirements/no-deps.txt | sed -n 's/^\s*\([A-Za-z0-9._-]*\).*/\1/p' \
  | tr 'A-Z_.' 'a-z--' | grep -v '^$' || true)

frozen=$("$py" -m pip freeze --exclude-editable 2>/dev/null | grep -v '^#' | grep -v '^-e ' \
  | awk -v skip="$skip" 'BEGIN { n = split(skip, s, "\n"); for (i = 1; i <= n; i++) drop[s[i]] = 1 }
      { name = tolower($0); sub(/[=<>@ ].*/, "", name); gsub(/[_.]/, "-", name); if (!(name in drop)) print }')
[ -n "$frozen" ] || die "pip freeze printed nothing for $py"

tmp_out="$out.tmp.$$"
{
  echo "# Exact dependency set, resolved by pip on CPython 3.12 / Linux x86_64 (pip freeze)."
  echo "# Regenerate: scripts/lock.sh. robosuite is in no-deps.txt (installed without its dependency list)."
  printf '%s\n' "$frozen"
} >"$tmp_out"
mv "$tmp_out" "$out"
log "wrote $out ($(printf '%s\n' "$frozen" | wc -l) pins)"
