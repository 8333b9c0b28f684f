"""The interaction data and the re-ranking examples built from it.

`dataset` loads the published or raw files, k-core filters them, splits them
leave-one-out and reads and writes the prepared files; `semantic_ids` builds the
items' semantic ids when none are given; `candidates` turns (history, target)
examples into K-candidate lists with a pre-ranker (cross-fitted on training users).
"""
