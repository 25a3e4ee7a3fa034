"""Names shared by the key statuses of the section classes: the modules that read keys, the features
rlfabric refuses as a whole, and the reasons that many inert keys share.

A module path here is where a key is read today; `tests/common/test_config_keys.py` checks that each
named module really contains the attribute access, so a moved reader fails the test instead of leaving
a stale table in docs/config.md.
"""

from __future__ import annotations

from services.common.config.schema import inert

# Readers (paths from the repository root).
DERIVED = "services/common/config/derived.py"
VALIDATION = "services/common/config/validation.py"
ALGORITHM = "services/common/config/algorithm.py"
ALGORITHM_VARIANTS = "services/common/config/loss_variants.py"
RESUME = "services/common/config/resume.py"
HF_CHECK = "services/common/config/hf_check.py"
MOE_RULES = "services/common/config/moe.py"
LOADER = "services/common/config/loader.py"
CONFIG_SECTIONS = "services/common/config/sections.py"
TRAINER_OPTIONS = "services/trainer/options.py"
ACTIVATIONS = "services/common/config/activations.py"
TRAINER_LAUNCH = "services/trainer/launch.py"
COORDINATOR_SETTINGS = "services/coordinator/settings.py"
ITERATION = "services/coordinator/iteration.py"
COORDINATOR_APP = "services/coordinator/app.py"
COORDINATOR_RUN = "services/coordinator/run.py"
COORDINATOR_VALIDATION = "services/coordinator/validation.py"
ROLLOUT_OPTIONS = "services/rollout/options.py"
ROLLOUT_CLI = "services/rollout/cli.py"
MULTI_TURN_RULES = "services/common/config/multi_turn.py"
LORA_RULES = "services/common/config/lora.py"
PPO_RULES = "services/common/config/ppo.py"
ROUTING_REPLAY = "services/common/config/routing_replay.py"
PARTIAL_ROLLOUT_RULES = "services/common/config/partial_rollout.py"

# Features rlfabric does not have: a config using one is refused with one message naming it.
DPO = "DPO (pairwise preference training)"
MULTIMODAL = "multimodal models"
REWARD_MODEL = "reward models"

# Reasons shared by many inert keys.
KERNEL = inert("kernel or fusion choice: the same math; rlfabric picks its kernels per platform "
               "(services/trainer/model.py)")
MEMORY = inert("memory or communication optimisation of Megatron/MindSpeed: the same math; rlfabric's trainer "
               "does not use it")
ASCEND = inert("Ascend-only runtime switch; rlfabric has no HCCL/CANN path here")
RAY = inert("Ray placement or transport of MindSpeed-RL; rlfabric places its services itself and moves "
            "data over gRPC")
FROM_HF = inert("the model is built from the Hugging Face config.json it loads (`tokenizer_name_or_path`); "
                "this key is not compared with it")
DISPATCH = inert("samples per MindSpeed-RL worker call (scheduling only); rlfabric's coordinator streams "
                 "samples to the services itself. Validated as upstream does")
UPSTREAM_UNUSED = inert("MindSpeed-RL's RL trainers do not read it either")

