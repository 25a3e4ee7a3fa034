"""Memory planning: predicted per-device memory of a run's actor, reference and rollout (`rlfabric plan`).

`arithmetic.py` holds the formulas (pure functions of model shape and layout) of state and KV cache,
`activations.py` those of activations, `experts.py` their mixture-of-experts terms, `inputs.py` what a plan is
computed from, `plan.py` reads that from a loaded config and applies the formulas to both placements, `advice.py`
says which keys to change when a placement does not fit, `cli.py` prints the result. docs/memory.md explains the
arithmetic.
"""
