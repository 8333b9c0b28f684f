"""Re-ranking evaluation and the decode-speed benchmark.

`rerank_eval` re-ranks candidate lists with a language model (any decoder) or a
fixed rule and judges every answer with the shared parser; `bench` times AR GR2
against the block-diffusion re-rankers and speculative decoding on the same prompts.
"""
