"""Offline corpus preparation: `python -m data_prep <command>`.

Commands (see `python -m data_prep --help`): fetch-corpus, train-tokenizer, prepare, finalize, verify,
inspect, relayout. The corpus format they write is defined once, in `txl_dist.data.format`.
"""
