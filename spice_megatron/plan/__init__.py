"""The layout planner behind `spice plan`.

The learner's TP/PP/DP/EP and the rollout engines for a cluster (`planner.py`), its memory model,
its time terms and their calibration against NeMo-RL's published throughput, the choice among
plans, the report, and the base models' config facts for planning without their weights
(`known_models.py`).

Layer 5: imports the shared modules, `data/`, `recipes/`, `selfplay/` (the context budget),
`policy/` and `bridge/` (the start-up checks)."""
