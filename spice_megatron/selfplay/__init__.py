"""SPICE's algorithm on the driver's side, with no engine or learner in it.

How a challenger turns a document into a task (`protocol.py`; `tasks.py`, at the package's top, is
the vocabulary every layer shares), one document's way through the rollouts (`doc_rollout.py`) and
when its requests go out (`schedule.py`), answer verification, the two roles' rewards, DrGRPO's
advantages and loss (`loss.py`), the prompt templates, the context budget, and one iteration's data
from documents to training samples (`iteration.py`). Generation is a function it is given
(`doc_rollout.GenerateFn`), so the same code runs against engines, tests and evaluations.

Layer 2: imports the shared modules and `data/`."""
