"""`python -m services.rollout ...`: the same as `rlfabric rollout serve ...`."""

import sys

# The guard matters: vLLM may spawn helper processes that re-import the main module.
if __name__ == "__main__":
    from services.rollout.cli import main

    sys.exit(main())
