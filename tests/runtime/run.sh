#!/usr/bin/env bash
# The C++ runtime rules of cmake/CxxRuntime.cmake, each shown on a tiny
# library (tests/runtime/probe.cpp):
#   1. the hazard is real and the check catches it: a plain link whose first
#      libstdc++ is a broken .so link next to libstdc++.a (the GPU image's
#      compiler directory), and a plain -static-libstdc++ -Bsymbolic link,
#      both embed a private runtime, and check_cxx_runtime.sh fails them;
#   2. the first link line through CxxRuntime.cmake gives a clean library;
#   3. -static-libstdc++ is refused at configure time.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
check="$here/../../cmake/check_cxx_runtime.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
CXX=${CXX:-c++}
fails=0
expect() {  # expect NAME ok|fail COMMAND...
  local name=$1 want=$2
  shift 2
  if "$@" >"$work/$name.log" 2>&1; then got=ok; else got=fail; fi
  if [ "$got" = "$want" ]; then
    echo "runtime: $name: $got, as expected"
  else
    echo "runtime: $name: $got, expected $want"; sed 's/^/    /' "$work/$name.log"; fails=$((fails + 1))
  fi
}

# A compiler directory like the GPU image's: libstdc++.so a broken link, libstdc++.a real.
static_a=$($CXX -print-file-name=libstdc++.a)
mkdir -p "$work/gcc"
ln -s "$work/gcc/missing/libstdc++.so.6" "$work/gcc/libstdc++.so"
ln -s "$static_a" "$work/gcc/libstdc++.a"
bad_flags="-L$work/gcc"

$CXX -shared -fPIC "$here/probe.cpp" $bad_flags -o "$work/plain.so"
expect 1-hazard-detected fail bash "$check" "$work/plain.so"
grep -q "defines libstdc++ internals" "$work/1-hazard-detected.log" || { echo "runtime: 1: the check did not name the internals"; fails=$((fails + 1)); }
$CXX -shared -fPIC "$here/probe.cpp" -static-libstdc++ -Wl,-Bsymbolic -o "$work/static.so"
expect 1-static-detected fail bash "$check" "$work/static.so"

expect 2-configure ok cmake -S "$here" -B "$work/b2" "-DCMAKE_SHARED_LINKER_FLAGS=$bad_flags"
expect 2-repaired ok cmake --build "$work/b2"
expect 2-check ok bash "$check" "$work/b2/libprobe.so"

expect 3-refused fail cmake -S "$here" -B "$work/b3" "-DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++ -Wl,-Bsymbolic"
grep -q "asks for a static C++ runtime" "$work/3-refused.log" || { echo "runtime: 3: no refusal message"; fails=$((fails + 1)); }

if [ $fails -eq 0 ]; then echo "runtime: 6 passed, 0 failed"; else echo "runtime: $((6 - fails)) passed, $fails failed"; exit 1; fi
