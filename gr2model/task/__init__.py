"""The re-ranking task as text, and how an answer is scored.

`rerank_format` defines the prompts, the responses and the strict parser that every
stage shares; `tokenizer` the Hugging Face tokenizer of that format; `rewards` the
conditional verifiable reward of the RL stages; `metrics` the ranking metrics
(Recall@k, NDCG@k, bootstrap intervals) of retrieval and re-ranking alike.
"""
