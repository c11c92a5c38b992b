#!/usr/bin/env bash
# perf_analyzer from PyPI's perf-analyzer 2.60.0, on this machine.
#
#   loadtest/perf_analyzer.sh -m ensemble -u 127.0.0.1:8001 -i grpc --streaming ...
#
# The wheel's binary needs glibc >= 2.38. Where the system's is older (Debian 12 has 2.36),
# the first run fetches Debian 13's loader and C/C++ runtime (apt-get download, no install)
# into .run/perf_analyzer/sysroot and runs the binary through that loader. Nothing outside
# .run/ changes.
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)  # also when called through a link
DIR=$ROOT/.run/perf_analyzer
PY=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$DIR/pkg/perf_analyzer/bin/perf_analyzer
LIBS="libc6 libstdc++6 libgcc-s1 libssl3t64 zlib1g"

if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR/wheel"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
    --python-version 3.11 perf-analyzer==2.60.0 -d "$DIR/wheel"
  "$PY" -m zipfile -e "$DIR"/wheel/perf_analyzer-2.60.0-*.whl "$DIR/pkg"
  chmod +x "$BIN"
fi

glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
if "$PY" -c "import sys; sys.exit(tuple(map(int, '$glibc'.split('.'))) >= (2, 38))"; then
  SYSROOT=$DIR/sysroot
  if [ ! -e "$SYSROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ]; then
    mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/cache/archives/partial" "$DIR/debs" "$SYSROOT"
    echo "deb http://deb.debian.org/debian trixie main" > "$DIR/apt/sources.list"
    APT=(-oDir::Etc::SourceList="$DIR/apt/sources.list" -oDir::Etc::SourceParts=/dev/null
         -oDir::State::Lists="$DIR/apt/lists" -oDir::Cache="$DIR/apt/cache")
    apt-get "${APT[@]}" update -qq
    (cd "$DIR/debs" && apt-get "${APT[@]}" download -qq $LIBS)
    for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$SYSROOT"; done
  fi
  LIBDIR=$SYSROOT/usr/lib/x86_64-linux-gnu
  exec "$LIBDIR/ld-linux-x86-64.so.2" --library-path "$LIBDIR" "$BIN" "$@"
fi
exec "$BIN" "$@"
