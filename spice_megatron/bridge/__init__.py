"""Weights between Hugging Face checkpoints, the Megatron learner and the rollout engines.

Layer 4: imports the shared modules and `policy/` (the learner's weights and layout); never
`rollout/`, which imports it."""
