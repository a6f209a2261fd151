#!/usr/bin/env bash
# The table of issue 16: blk.11.ffn_up block scales x1.02/1.05/1.10, the old command against the new one.
# Usage: bash tools/planted_scale_table.sh  (prints Markdown rows; results/local/issue-table.md)
cd "${TMPDIR:-/tmp}"
M=~/.cache/llorch_ref/models/SmolLM2-135M-Instruct.Q4_1.gguf
for f in 1.02 1.05 1.10; do
  python -c "from llorch_ref.testing.plant import plant_scale; plant_scale('$M', '/dev/shm/up11.gguf', 'blk.11.ffn_up.weight', $f)"
  llorch-ref diff --reference-model /dev/shm/up11.gguf --json > /tmp/before_$f.json 2>/dev/null
  llorch-ref dump --engine llamacpp --model /dev/shm/up11.gguf --out /tmp/after_$f.safetensors --overwrite > /dev/null 2>&1
  llorch-ref diff --subject /tmp/after_$f.safetensors --model $M --json > /tmp/after_$f.json 2>/dev/null
  python - $f <<'PY'
import json, sys
f = sys.argv[1]
b = json.load(open(f"/tmp/before_{f}.json")); a = json.load(open(f"/tmp/after_{f}.json"))
def w(fd): return "none" if fd is None else f"checkpoint {fd['checkpoint']}, layer {fd['layer']}, {fd['tensor']} (by {fd.get('by','end-to-end error')})"
row = next(r for r in a["rows"] if r["layer"] == 11 and r["tensor"] == "ffn_swiglu")
print(f"| x{f} | {'passes every checkpoint' if b['first_divergence'] is None else 'fails'} | {w(b['first_divergence'])} | {w(a['first_divergence'])} | {row['local']['nmse']:.3e} (band {row['local_band']['nmse']:.0e}) |")
PY
done
