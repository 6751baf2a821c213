#!/usr/bin/env bash
# Lever 6 against PyTorch's own: per-rank peak memory (resident set, from /usr/bin/time around each
# rank) and tokens/s of headroom's --shard none|optimizer|gradients|full next to DDP and FSDP2 training
# the same architecture (bench/tiny_model.py) with the same per-rank batch on 2 cpu ranks, in one run.
# headroom's own counted tensor peak per rank is printed too. Run from the repository root after a
# build:  bash bench/dist_compare.sh [layers=4] [hidden=1024] [steps=6]
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-4}; HIDDEN=${2:-1024}; STEPS=${3:-6}; B=4; T=128; N=2
INTER=$(( HIDDEN * 11 / 4 ))
PY="${HEADROOM_PYTHON:-$HOME/.cache/headroom/venv/bin/python}"
TORCHRUN="$(dirname "$PY")/torchrun"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
export OMP_NUM_THREADS=1
sets="--set num_hidden_layers=$LAYERS --set hidden_size=$HIDDEN --set intermediate_size=$INTER"
pysets="num_hidden_layers=$LAYERS hidden_size=$HIDDEN intermediate_size=$INTER"
rss() {  # the largest rank's peak RSS, bytes
  local m=0; for f in "$W"/rss.*; do v=$(tail -1 "$f"); (( v > m )) && m=$v; done; rm -f "$W"/rss.*; echo $(( m * 1024 ))
}
printf '%-22s %14s %16s %10s\n' "2 cpu ranks, tiny x$LAYERS @ $HIDDEN" "peak RSS/rank" "tensors/rank" "tok/s"
declare -A RSS TOK
for level in none optimizer gradients full; do
  "$TORCHRUN" --standalone --nproc-per-node $N --no-python sh -c \
    "exec /usr/bin/time -f %M -o $W/rss.\$RANK build/headroom train --device cpu --model tiny $sets --batch $B --seq $T \
     --steps $STEPS --eval-rows 0 --quiet --json --shard $level --metrics $W/m.jsonl" > "$W/out.json" 2>/dev/null
  RSS[$level]=$(rss)
  read -r TOK[$level] tensors < <("$PY" - "$W/out.json" "$W/m.jsonl" <<'PY'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
steps = [json.loads(l) for l in open(sys.argv[2])][1:]
print(f'{sum(r["tokens"] for r in steps) / sum(r["seconds"] for r in steps):.1f}', max(s["rank_peak_bytes"]))
PY
)
  printf '%-22s %14s %16s %10s\n' "headroom --shard $level" "${RSS[$level]}" "$tensors" "${TOK[$level]}"
done
for impl in ddp fsdp2; do
  "$TORCHRUN" --standalone --nproc-per-node $N --no-python sh -c \
    "exec /usr/bin/time -f %M -o $W/rss.\$RANK $PY bench/dist_baseline.py $impl $B $T $STEPS $pysets" \
    > "$W/py.json" 2>/dev/null
  RSS[$impl]=$(rss)
  TOK[$impl]=$("$PY" -c "import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['tokens_per_s'])" "$W/py.json")
  printf '%-22s %14s %16s %10s\n' "pytorch $impl" "${RSS[$impl]}" "-" "${TOK[$impl]}"
done
"$PY" - "${RSS[none]}" "${RSS[ddp]}" "${RSS[gradients]}" "${RSS[full]}" "${RSS[fsdp2]}" \
  "${TOK[none]}" "${TOK[ddp]}" "${TOK[gradients]}" "${TOK[full]}" "${TOK[fsdp2]}" <<'PY'
import sys
r = [float(x) for x in sys.argv[1:]]
# FSDP2's fully_shard shards the parameters too: headroom's full is its like; gradients for reference.
print(f"peak RSS ratio: headroom none / DDP {r[0] / r[1]:.3f}; full / FSDP2 {r[3] / r[4]:.3f}; "
      f"gradients / FSDP2 {r[2] / r[4]:.3f}")
print(f"tokens/s ratio: headroom none / DDP {r[5] / r[6]:.3f}; full / FSDP2 {r[8] / r[9]:.3f}; "
      f"gradients / FSDP2 {r[7] / r[9]:.3f}")
PY
