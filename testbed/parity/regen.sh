#!/bin/sh
# Regenerates the tokenizer/chat-template golden files in pkg/tokenizer/testdata
# and the staged tokenizer files in testdata/tokenizers from the pinned npm
# reference packages, then fails if anything changed (CI runs this to prove
# the committed goldens are fresh). Also prints the Rust tokenizer's speed on
# the benchmark prompt next to Go's, in the same run.
#
#   testbed/parity/regen.sh            regenerate + diff + benchmark
#   testbed/parity/regen.sh --no-bench regenerate + diff only
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
npm ci --no-audit --no-fund --loglevel=error
node gen.mjs "$root"
cd "$root"
status=0
git diff --exit-code --stat -- pkg/tokenizer/testdata testdata/tokenizers || status=1
untracked=$(git ls-files --others --exclude-standard -- pkg/tokenizer/testdata testdata/tokenizers)
if [ -n "$untracked" ]; then
	echo "untracked generated files:"; echo "$untracked"; status=1
fi
if [ "$status" -ne 0 ]; then
	echo "golden files are stale: commit the regenerated files" >&2
	exit "$status"
fi
echo "golden files are up to date"
if [ "${1:-}" != "--no-bench" ]; then
	echo "Rust tokenizers (npm) on pkg/tokenizer/testdata/bench_prompt.txt:"
	rust=$(cd "$here" && node gen.mjs "$root" bench)
	echo "$rust"
	echo "Go pkg/tokenizer on the same prompt:"
	go test -run '^$' -bench 'BenchmarkEncodePrompt' -benchtime 200x -count 1 ./pkg/tokenizer/ | tee /tmp/loxilb-tokenizer-bench.$$
	# Ratio = Go tokens/s divided by Rust tokens/s (>= 1 means Go is faster).
	node -e '
const rust = JSON.parse(process.argv[1]);
const lines = require("fs").readFileSync(process.argv[2], "utf8").split("\n");
for (const l of lines) {
  const m = l.match(/BenchmarkEncodePrompt\/(\w+)\S*\s+\d+\s+([\d.]+) ns\/op/);
  if (!m || !rust[m[1]]) continue;
  const goNs = parseFloat(m[2]);
  const ratio = rust[m[1]].ns_per_op / goNs;
  console.log(`${m[1]}: Go ${goNs.toFixed(0)} ns/op, Rust ${rust[m[1]].ns_per_op} ns/op, Go speed = ${ratio.toFixed(2)}x Rust`);
}' "$rust" /tmp/loxilb-tokenizer-bench.$$
	rm -f /tmp/loxilb-tokenizer-bench.$$
fi
