"""Imported by the pool's forkserver only: loads and warms the verifiers once, before any fork."""

from services.reward.pool_child import warm_up

warm_up()
