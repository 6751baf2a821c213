#!/usr/bin/env bash
# The families at their real widths and vocabularies: for each preset, one layer, the estimate
# (headroom estimate --json) against the peak headroom train measures on the cpu over two steps,
# bf16 with SGD at 1 x 256 tokens so that the largest (Mixtral-8x7B's eight experts, about 1.7B
# parameters) stays under 10 GB. Prints a markdown row per preset; docs/benchmarks.md holds a run.
#
#   bench/families_check.sh [PRESET...]      (after make build; default: the seven below)
set -euo pipefail
cd "$(dirname "$0")/.."
H=build/headroom
PY="${HEADROOM_CACHE:-$HOME/.cache/headroom}/venv/bin/python"
[ -x "$H" ] || { echo "families_check: $H not built (make build first)" >&2; exit 2; }
presets=("$@")
((${#presets[@]})) || presets=(gemma-3-1b phi-3-mini smollm3-3b olmo-2-7b qwen3-8b qwen3-30b-a3b mixtral-8x7b)
failed=0
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "| preset (1 layer) | estimated peak (B) | measured peak (B) | error | wall |"
echo "| --- | ---: | ---: | ---: | ---: |"
for m in "${presets[@]}"; do
  args=(--model "$m" --set num_hidden_layers=1 --batch 1 --seq 256 --precision bf16 --optimizer sgd --device cpu)
  est=$("$H" estimate "${args[@]}" --json --quiet | "$PY" -c "import json,sys; print(json.load(sys.stdin).get('peak_bytes', ''))") || true
  [ -n "$est" ] || { echo "| $m | estimate failed (above) | | | |"; failed=1; continue; }
  SECONDS=0
  "$H" train "${args[@]}" --steps 2 --no-guard --quiet --metrics "$work/$m.jsonl" >"$work/$m.log" 2>&1 ||
    { echo "| $m | $est | train failed: $(tail -n 1 "$work/$m.log") | | |"; failed=1; continue; }
  "$PY" - "$m" "$est" "$work/$m.jsonl" "$SECONDS" <<'PY'
import json, sys
name, est, path, wall = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = [json.loads(line) for line in open(path) if line.strip()]
measured = max(r["peak_bytes"] for r in rows if "step" in r and r.get("peak_bytes"))
print(f"| {name} | {est:,} | {measured:,} | {est / measured - 1:+.4%} | {wall} s |")
PY
done
exit $failed
