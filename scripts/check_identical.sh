#!/usr/bin/env bash
# Byte-identity check between two strata binaries (e.g. before and after a
# refactor): every test fixture, at --tp 1/2/4, several --max-batch-tokens,
# both formats and several storage dtypes, every capture point. Every output
# file must be the same bytes; a run that one binary refuses must be refused
# by the other too.
#
#   cargo build --release && cp target/release/strata /tmp/strata-after
#   git stash; cargo build --release; cp target/release/strata /tmp/strata-before; git stash pop
#   scripts/check_identical.sh /tmp/strata-before /tmp/strata-after
#
# Extra arguments after the two binaries are passed to both (e.g. --backend cpu,
# which only the newer one knows, is not passed by default).
set -euo pipefail
before=$1
after=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

runs=0
refused=0
fail=0

points() { # every capture point of a fixture
  python3 - "$1" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
n = c.get("text_config", c)["num_hidden_layers"]
print(",".join(["embeddings"] + [f"input:{k}" for k in range(n)] + [f"output:{k}" for k in range(n)] + ["final", "final-norm"]))
EOF
}

compare() { # name, args...
  local name=$1
  shift
  local a="$work/a" b="$work/b"
  rm -rf "$a" "$b"
  local sa=0 sb=0
  "$before" extract "$@" --out "$a" >/dev/null 2>"$work/ea" || sa=$?
  "$after" extract "$@" --out "$b" >/dev/null 2>"$work/eb" || sb=$?
  runs=$((runs + 1))
  if [ "$sa" != 0 ] || [ "$sb" != 0 ]; then
    if [ "$sa" != 0 ] && [ "$sb" != 0 ]; then
      refused=$((refused + 1))
    else
      echo "DIFFERENT EXIT ($sa vs $sb): $name $*"
      cat "$work/ea" "$work/eb"
      fail=$((fail + 1))
    fi
    return
  fi
  if ! diff -r "$a" "$b" >/dev/null; then
    echo "DIFFERENT OUTPUT: $name $*"
    diff -r "$a" "$b" | head -5 || true
    fail=$((fail + 1))
  fi
}

for dir in "$here"/tests/fixtures/*/; do
  name=$(basename "$dir")
  list=$(points "$dir")
  data="$dir/data.jsonl"
  for tp in 1 2 4; do
    for budget in 5 7 20 8192; do
      compare "$name" --model "$dir" --data "$data" --capture "$list" --dtype f32 --tp "$tp" \
        --max-batch-tokens "$budget" --shard-size 2000 "$@"
    done
    compare "$name" --model "$dir" --data "$data" --capture "$list" --tp "$tp" --format speculators "$@"
    compare "$name" --model "$dir" --data "$data" --capture eagle3 --dtype f16 --tp "$tp" --max-batch-tokens 11 "$@"
  done
done
# The embedded demo (the README's first command).
compare embedded "$@"

echo "$runs runs, $refused refused by both, $fail differences"
[ "$fail" = 0 ]
