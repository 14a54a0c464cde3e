"""txl-dist: distributed pretraining of Transformer-XL language models."""
__version__ = "0.1.0"
