#!/usr/bin/env bash
# The README's Python install steps in a brand-new venv, then `import rotary`
# from outside the tree and one op:
#
#     python3 -m venv .venv && . .venv/bin/activate
#     pip install torch==2.11.0 setuptools wheel
#     pip install --no-build-isolation .
#
# Usage: bash tests/install/fresh_venv.sh VENV_PYTHON BUILD_DIR
# (make test-fresh-install passes .venv/bin/python and build/).
#
# Two shortcuts keep it to well under two minutes; neither touches the steps
# a user runs:
# - torch is not downloaded again (with its CUDA wheels it is gigabytes). The
#   new venv sees VENV_PYTHON's torch and torch's dependencies through a .pth
#   file naming a folder of links to them (link_closure.py). pip, setuptools
#   and wheel are not linked: the new venv has only the packaging tools
#   `python -m venv` gives it, as a user's would.
# - ROTARY_BUILD_DIR=BUILD_DIR: setup.py packages the libraries that tree
#   holds (after bringing it up to date) instead of compiling them again.
#
# Before the second step, the third is run once in the bare venv. Where the
# venv cannot build wheels yet, it must fail and say what to install.
# setuptools and wheel come from PyPI (pip's PIP_INDEX_URL / PIP_FIND_LINKS
# apply); with no index reachable they are linked from VENV_PYTHON instead,
# and the script says so.
set -euo pipefail

VPY=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")   # absolute; the venv link itself, not resolved
BUILD=$(cd "$2" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tests/install

# The steps below must be the README's, word for word.
STEP_VENV='python3 -m venv .venv && . .venv/bin/activate'
STEP_DEPS='pip install torch==2.11.0 setuptools wheel'
STEP_INSTALL='pip install --no-build-isolation .'
for step in "$STEP_VENV" "$STEP_DEPS" "$STEP_INSTALL"; do
  grep -qxF "$step" "$ROOT/README.md" || {
    echo "fresh-install: README.md no longer has the line: $step (update tests/install/fresh_venv.sh with it)"; exit 1; }
done

# The interpreter that made VENV_PYTHON's venv, not the venv itself.
BASE=$("$VPY" -c 'import sys; print(f"{sys.base_prefix}/bin/python{sys.version_info[0]}.{sys.version_info[1]}")')
TMP=$(mktemp -d /tmp/rotary-fresh-install.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_RETRIES=${PIP_RETRIES:-1} PIP_TIMEOUT=${PIP_TIMEOUT:-15}

echo "fresh-install: venv from $BASE in $TMP/.venv"
cd "$TMP"
set +u
eval "${STEP_VENV/python3 /$BASE }"   # `python3`, but the base interpreter of VENV_PYTHON
set -u
[ "$(command -v pip)" = "$TMP/.venv/bin/pip" ] || { echo "fresh-install: activate did not put the venv's pip first"; exit 1; }

echo "fresh-install: torch and its dependencies from $VPY, through a .pth file"
"$VPY" "$HERE/link_closure.py" "$TMP/shared" torch
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$TMP/shared" > "$SITE/rotary-test-shared-torch.pth"

cd "$ROOT"
export ROTARY_BUILD_DIR=$BUILD
if python -c 'from setuptools.dist import Distribution; Distribution().get_command_class("bdist_wheel")' 2>/dev/null; then
  echo "fresh-install: this venv's setuptools builds wheels without the wheel package; no failure to check"
else
  echo "fresh-install: '$STEP_INSTALL' before '$STEP_DEPS' must fail and name the fix"
  if $STEP_INSTALL > "$TMP/early.log" 2>&1; then
    cat "$TMP/early.log"; echo "fresh-install: it installed without setuptools and wheel?"; exit 1
  fi
  grep -qF "Run \`$STEP_DEPS\` first" "$TMP/early.log" || grep -qF "setuptools.build_meta" "$TMP/early.log" || {
    cat "$TMP/early.log"; echo "fresh-install: the failure does not say what to install"; exit 1; }
  grep -m1 -F "rotary: " "$TMP/early.log" || grep -m1 -F "setuptools.build_meta" "$TMP/early.log"
fi

echo "fresh-install: $STEP_DEPS"
if ! $STEP_DEPS > "$TMP/deps.log" 2>&1; then
  if grep -qE "from versions: none|NewConnectionError|Temporary failure in name resolution" "$TMP/deps.log"; then
    echo "fresh-install: no package index reachable; setuptools and wheel linked from $VPY instead"
    "$VPY" "$HERE/link_closure.py" "$TMP/shared" setuptools wheel
  else
    cat "$TMP/deps.log"; exit 1
  fi
fi
grep -E "^(Successfully installed|Requirement already satisfied: torch)" "$TMP/deps.log" || true

echo "fresh-install: ROTARY_BUILD_DIR=$BUILD $STEP_INSTALL"
$STEP_INSTALL > "$TMP/install.log" 2>&1 || { cat "$TMP/install.log"; exit 1; }
grep -E "^Successfully installed" "$TMP/install.log"

cd "$TMP"
python - "$TMP/.venv" <<'EOF'
import sys
from pathlib import Path

import torch
import rotary

venv = Path(sys.argv[1]).resolve()
where = Path(rotary.__file__).resolve()
assert venv in where.parents, f"rotary imported from {where}, not from the new venv {venv}"
x = torch.randn(1, 2, 3, 8)
y = rotary.RotaryEmbedding(8, 16)(x, start_pos=2)
ref = rotary.apply_rope(x, rotary.freqs_table(8, 16), 2)
assert torch.allclose(y, ref), "module and op disagree"
print(f"fresh-install: ok, rotary from {where.parent}, torch {torch.__version__}, output {tuple(y.shape)}")
EOF
