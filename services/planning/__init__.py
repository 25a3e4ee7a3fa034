"""Memory planning: predicted per-device memory of a run's actor, reference and rollout (`rlfabric plan`).

`arithmetic.py` holds the formulas (pure functions of model shape and layout), `experts.py` their
mixture-of-experts terms, `plan.py` applies them to a loaded config and both placements, `advice.py` says which
keys to change when a placement does not fit, `cli.py` prints the result. docs/memory.md explains the arithmetic.
"""
