#!/usr/bin/env bash
# Fails when a shared library carries its own copy of the C++ runtime, or
# does not load the shared one: each must have NEEDED libstdc++.so.6 and
# define none of libstdc++'s own symbols (locale, iostream init, the integer
# inserter that error messages use).
# Usage: check_cxx_runtime.sh LIB...
set -u
status=0
internals='cxx11_locale_inst|std::locale::locale\(\)|std::ios_base::Init::Init\(\)|std::basic_ostream<char, std::char_traits<char> >& std::basic_ostream<char, std::char_traits<char> >::_M_insert<long>\(long\)'
for lib in "$@"; do
  ok=1
  if ! readelf -d "$lib" | grep -q 'NEEDED.*\[libstdc++\.so\.6\]'; then
    echo "check_cxx_runtime: FAIL $lib: no NEEDED libstdc++.so.6 (a static C++ runtime?)"
    ok=0
  fi
  found=$(nm -C --defined-only "$lib" 2>/dev/null | grep -E "$internals" | head -3)
  if [ -n "$found" ]; then
    echo "check_cxx_runtime: FAIL $lib: defines libstdc++ internals (a private copy of the C++ runtime):"
    echo "$found" | sed 's/^/    /'
    ok=0
  fi
  if [ $ok -eq 1 ]; then
    echo "check_cxx_runtime: ok $lib"
  else
    status=1
  fi
done
exit $status
