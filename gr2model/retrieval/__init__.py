"""The pre-ranker: the scorers that rank the whole catalogue and pick each list's candidates.

`scoring` holds the scorer protocol and chunked full-catalogue evaluation,
`sasrec` the SASRec model and its training loop, `baselines` the non-neural scorers
(popularity, item transitions) and score ensembles, and `retriever` the checkpoint
folder that bundles SASRec with the transition model.
"""
