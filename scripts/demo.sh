#!/usr/bin/env bash
# The README's main job, from nothing to a report, on CPU:
#   install -> embedded corpus + tokenizer + indexed dataset -> train standard and coupled
#   (each a 2-task job through launch/submit.py --cluster local: same data, seed and
#   settings) -> validation perplexity ->
#   export the coupled model to Hugging Face and sample from it -> analysis report.
# Interrupt it (Ctrl-C) and run it again: finished stages are skipped, training resumes
# from its last complete checkpoint.
#   DEMO_OUT=demo_out DEMO_STEPS=300 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUT:-demo_out}
STEPS=${DEMO_STEPS:-300}
export DS_ACCELERATOR=cpu WANDB_SILENT=true PYTHONWARNINGS=ignore

[ "${DEMO_SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
PY=.venv/bin/python

echo "== 1/5 embedded corpus, tokenizer and indexed dataset -> $OUT/data"
"$PY" -m data_tools.demo_corpus --output "$OUT/data" --quiet

finished() { grep -q '"kind": "summary"' "$1/metrics.jsonl" 2>/dev/null; }

for variant in standard coupled; do
  name="demo-$variant"
  run="$OUT/runs/$name"
  if finished "$run"; then
    echo "== 2/5 $name: already trained ($run)"
    continue
  fi
  echo "== 2/5 training $name: launch/submit.py --cluster local, 2 tasks (data parallel,"
  echo "   DeepSpeed ZeRO-1), $STEPS steps; job logs in $run/submitit/"
  "$PY" launch/submit.py --cluster local --profile configs/clusters/local.yaml --tasks 2 \
    --config configs/runs/demo.yaml \
    "name=$name" "attention.coupling=$([ "$variant" = coupled ] && echo hamiltonian || echo none)" \
    "train.train_steps=$STEPS" "train.eval_interval=$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))" \
    "train.save_interval=$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))" "log.root=$OUT/runs" \
    "data.prefixes=[$OUT/data/demo_text_document]" "data.tokenizer=$OUT/data/tokenizer.model"
done

echo "== 3/5 validation perplexity"
for variant in standard coupled; do
  "$PY" - "$OUT/runs/demo-$variant/metrics.jsonl" <<'PYEOF'
import json, sys
final = [r for r in map(json.loads, open(sys.argv[1])) if r.get("final")][-1]
print(f"  {sys.argv[1].split('/')[-2]:<16} validation loss {final['val_loss']:.4f}  perplexity {final['val_ppl']:.2f}")
PYEOF
done

HF="$OUT/hf/demo-coupled"
echo "== 4/5 export demo-coupled to Hugging Face -> $HF, then sample"
if [ ! -f "$HF/config.json" ]; then
  ppl=$("$PY" -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r.get('final')][-1]['val_ppl'])" "$OUT/runs/demo-coupled/metrics.jsonl")
  "$PY" -m cqk_megatron.convert.cli export "$OUT/runs/demo-coupled" "$HF" \
    --tokenizer "$OUT/data/tokenizer.model" --val-ppl "$ppl"
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

echo "== 5/5 analysis report -> $OUT/report"
"$PY" -m cqk_megatron.analysis report "$OUT/runs" --out "$OUT/report"

cat <<EOF2

Done. Where everything is:
  corpus, tokenizer, dataset  $OUT/data/
  runs (config, metrics.jsonl, checkpoints, wandb offline)  $OUT/runs/demo-standard/, $OUT/runs/demo-coupled/
  Hugging Face export         $HF/
  report                      $OUT/report/report.md (and PNG figures)
EOF2
