#!/usr/bin/env bash
# The README's main job, from nothing to a scaling analysis, on CPU:
#   install -> embedded corpus + tokenizer + indexed dataset -> a mini-ladder (3 model
#   sizes x {standard, coupled}, configs/sweeps/demo.yaml) as ONE sweep through
#   cqk submit --sweep ... --cluster local -> validation perplexity -> export the
#   largest coupled model to Hugging Face and sample from it -> the analysis report
#   (L(N, D) fits with bootstrap intervals, data-efficiency multiplier, loss vs compute).
# Interrupt it (Ctrl-C) and run it again: finished stages and runs are skipped, the other
# runs resume from their last complete checkpoint.
#   DEMO_OUT=demo_out bash scripts/demo.sh
# DEMO_STEPS=N trains every run for N steps instead of the sweep's budget (tests);
# DEMO_BOOTSTRAP=N sets the report's bootstrap resamples (default 200);
# DEMO_SKIP_INSTALL=1 skips the install; VENV=path uses (and installs into) that
# environment (scripts/venv.sh).
set -euo pipefail
source "$(dirname "$0")/venv.sh"
OUT=$(realpath -m -s "${DEMO_OUT:-demo_out}")  # relative to where the command started
cd "$REPO"
SWEEP=configs/sweeps/demo.yaml
BOOTSTRAP=${DEMO_BOOTSTRAP:-200}
export DS_ACCELERATOR=cpu WANDB_SILENT=true PYTHONWARNINGS=ignore

[ "${DEMO_SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
require_python

echo "== 1/5 embedded corpus, tokenizer and indexed dataset -> $OUT/data"
"$PY" -m data_tools.demo_corpus --out "$OUT/data" --quiet

overrides=("log.root=$OUT/runs" "data.prefixes=[$OUT/data/demo_text_document]"
  "data.tokenizer=$OUT/data/tokenizer.model")
if [ -n "${DEMO_STEPS:-}" ]; then
  quarter=$(( DEMO_STEPS / 4 > 0 ? DEMO_STEPS / 4 : 1 ))
  overrides+=("train.train_steps=$DEMO_STEPS" "train.eval_interval=$quarter"
    "train.checkpoint.save_interval=$quarter" "train.schedule.warmup_steps=1")
fi
echo "== 2/5 the mini-ladder: one sweep ($SWEEP: 3 sizes x standard, coupled) through"
echo "   cqk submit --cluster local, one task per run, two runs at a time;"
echo "   run folders and job logs in $OUT/runs/"
"$PY" launch/submit.py --sweep "$SWEEP" --cluster local --profile configs/clusters/local.yaml \
  "${overrides[@]}"

echo "== 3/5 validation perplexity (final evaluation of each run)"
# Prints the table; the last line is the largest coupled run's folder and perplexity.
largest=$("$PY" - "$OUT/runs" <<'PYEOF'
import json, sys
from pathlib import Path
rows = []
for metrics in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl")):
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    final = [r for r in records if r.get("final")][-1]
    summary = [r for r in records if r["kind"] == "summary"][-1]
    rows.append((summary["params_non_embedding"], metrics.parent, final))
for params, folder, final in sorted(rows, key=lambda r: (r[0], r[1].name)):
    print(f"  {folder.name:<24} {params:>9,} non-embedding params  validation loss "
          f"{final['val_loss']:.4f}  perplexity {final['val_ppl']:.2f}", file=sys.stderr)
params, folder, final = max((r for r in rows if "-coupled-" in r[1].name), key=lambda r: r[0])
print(folder, final["val_ppl"])
PYEOF
)
read -r RUN PPL <<<"$largest"
NAME=$(basename "$RUN")
HF="$OUT/hf/$NAME"
echo "== 4/5 export $NAME (the largest coupled model) to Hugging Face -> $HF, then sample"
if [ ! -f "$HF/config.json" ]; then
  "$PY" -m cqk_megatron convert export "$RUN" "$HF" \
    --tokenizer "$OUT/data/tokenizer.model" --val-ppl "$PPL"
fi
HF_HUB_OFFLINE=1 "$PY" - "$HF" <<'PYEOF'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
torch.manual_seed(0)
for prompt in ["def ", "The ", "    return "]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=True, top_k=20, temperature=0.8)
    print("  " + repr(tokenizer.decode(out[0], skip_special_tokens=True)))
PYEOF

echo "== 5/5 scaling analysis over the runs -> $OUT/report"
# What the report was made from: the resamples and every run's metrics file as it is now.
# The same again (a second run of the demo after all runs finished): a finished stage,
# skipped.
inputs="bootstrap=$BOOTSTRAP $(cd "$OUT/runs" && stat -c '%n %s %Y' -- */metrics.jsonl | tr '\n' ' ')"
if [ -f "$OUT/report/report.md" ] && [ "$(cat "$OUT/report/inputs.txt" 2>/dev/null)" = "$inputs" ]; then
  echo "   skipped: the report of these runs is there already"
else
  "$PY" -m cqk_megatron.analysis report "$OUT/runs" --out "$OUT/report" \
    --multiplier-at measured --bootstrap "$BOOTSTRAP"
  printf '%s\n' "$inputs" >"$OUT/report/inputs.txt"
fi
# the two tables a reader looks for first, from the report itself
sed -n '/^## Scaling-law fits/,/^!\[/p; /^## Data-efficiency multiplier/,/^!\[/p' \
  "$OUT/report/report.md" | grep -v '^!\['

cat <<EOF2

Done. Where everything is:
  corpus, tokenizer, dataset  $OUT/data/
  runs (config, metrics.jsonl, jobs.jsonl, checkpoints, job logs, wandb offline)  $OUT/runs/
  Hugging Face export         $HF/
  report                      $OUT/report/report.md (figures in $OUT/report/figures/)
EOF2
