"""The decoders: AR, block diffusion, speculative, and the answer grammar they can decode under.

`ar_decode` is the KV-cache AR loop (and HF `generate` for comparison),
`diffusion_decode` the threshold block decoder with its block KV cache,
`speculative` drafts with a diffusion model and verifies with the AR one, and
`constrained` restricts any of them to valid JSON rankings.
"""
