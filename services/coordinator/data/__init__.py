"""Training data: MindSpeed-RL style preprocessing into Megatron indexed datasets, and the prompt loader.

- `dataset_config`: the dataset YAML (`configs/datasets/*.yaml`) as a strict dataclass.
- `readers`: raw rows from JSON, JSON arrays, JSONL and parquet, with row-numbered errors.
- `templates`: chat templates from `configs/model/templates.json`, rendered to prompt token ids.
- `handlers`: MindSpeed-RL's handlers (`R1AlpacaStyleInstructionHandler`, ...) turning a raw row into texts.
- `preprocess`: the parallel, atomic writer of `{output_prefix}_packed_{field}_document.{bin,idx}`.
- `loader`: `PromptLoader`, the coordinator's seeded, resumable batches of prompt and label token ids.

Modules import torch/megatron/transformers lazily so the CLI's `--help` stays fast.
"""

from services.coordinator.data.errors import DataError

__all__ = ["DataError"]
