"""The HuggingFace Transformer-XL reference (transformers 4.37.2) in its own venv, for parity tests.

refvenv.py  creates/reuses `.venv-ref` at the repository root and provides the `reference_python` fixture
hf_side.py  runs INSIDE `.venv-ref`: builds/loads HF models and writes their outputs to files
"""
