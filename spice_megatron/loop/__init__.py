"""The training loop's collaborators; `trainer.py`, at the package's top, is the loop itself.

The driver (rank 0's side of an iteration, in the trainer's process or one of its own), where an
iteration's rollouts come from in each mode (`rollout_sources.py`), the batch's delivery to every
learner rank, the learner's first forward during streamed rollouts, the engines' life (`engines.py`,
their one owner: sleep and wake around the step through `colocation.py`, the weight update through
`engine_weights.py`, their recovery), and what saves or ends a run around its iterations
(`run_guard.py`). `interfaces.py` holds the Protocols the loop talks through.

Layer 6: imports every layer below it."""
