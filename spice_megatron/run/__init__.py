"""A run directory's life beside the training.

Its lock (one writer), its config.json, how it talks to the job script and the person at the
keyboard (STOP, signals, end markers), its logs (metrics, TensorBoard, the audit trail) and their
reader, and `spice clean`. (`run_dir.py`, at the package's top, holds the safety rules every writer
of a run directory shares, the learner's checkpoints included.)

Layer 5: imports the shared modules and `policy/` (the checkpoints it finds)."""
