"""The networks and their checkpoint folders.

`ar_model` builds the AR re-ranker (a Qwen3-style causal LM), `block_diffusion`
converts it to a block-diffusion model (the block-causal mask, the mask token, the
decoding settings it records), and `checkpoint` writes and loads the Hugging Face
folders every stage hands on, with a marker written last.
"""
