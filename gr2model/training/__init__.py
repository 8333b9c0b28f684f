"""The trainers of every stage after retrieval, and what they share.

`midtrain` and `sft` train the AR re-ranker with next-token cross-entropy (`sft` also
owns the shared accelerate loop and the global-batch sharding), `dapo` is its RL;
`cft` converts it to block diffusion, `opd` distils GR2 into the converted student
and `diffusion_rl` is the student's RL, both scoring rollouts with
`diffusion_replay`; `kl` holds the per-token KL divergences and `resume` the
resumable training states every loop saves.
"""
