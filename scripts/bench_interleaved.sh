#!/usr/bin/env bash
# Runs two builds of a criterion bench alternately (before, after, after,
# before, ...) and prints each round's estimate and the medians, so that the
# machine's drift hits both sides alike.
#
#   git worktree add /tmp/base <commit>
#   (cd /tmp/base && CARGO_TARGET_DIR=/tmp/base-target cargo bench --bench forward --no-run)
#   cargo bench --bench forward --no-run
#   scripts/bench_interleaved.sh /tmp/base-target/release/deps/forward-<hash> \
#       target/release/deps/forward-<hash> 5
#
# Arguments: BEFORE_BIN AFTER_BIN [ROUNDS=5] [FILTER]
set -euo pipefail
before=$1
after=$2
rounds=${3:-5}
filter=${4:-}
estimate() { # the point estimate of criterion's "time: [lo est hi]" line, in ms
  "$1" --bench $filter 2>/dev/null | awk '/time:/ {
    v = $(NF-3); u = $(NF-2);
    if (u == "s") v *= 1000; else if (u == "µs" || u == "us") v /= 1000;
    print v; exit }'
}
b=()
a=()
for i in $(seq "$rounds"); do
  # Alternate which runs first (ABBA...), so a drift of the machine hits both sides alike.
  if [ $((i % 2)) = 1 ]; then
    x=$(estimate "$before")
    y=$(estimate "$after")
  else
    y=$(estimate "$after")
    x=$(estimate "$before")
  fi
  b+=("$x")
  a+=("$y")
  echo "round $i: before ${x} ms, after ${y} ms"
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
mb=$(median "${b[@]}")
ma=$(median "${a[@]}")
echo "median before ${mb} ms, after ${ma} ms, after/before $(awk -v a="$ma" -v b="$mb" 'BEGIN {printf "%.4f", a/b}')"
