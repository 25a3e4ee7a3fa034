"""Offline training data: MindSpeed-RL style preprocessing into Megatron indexed datasets (`rlfabric preprocess`).

- `dataset_config`: the dataset YAML (`configs/datasets/*.yaml`), parsed with the main config's schema
  machinery (`services/common/config`: file:line and closest-key errors).
- `readers`: raw rows from JSON, JSON arrays, JSONL and parquet, with row-numbered errors.
- `templates`: chat templates from `configs/model/templates.json`, rendered to prompt token ids.
- `handlers`: MindSpeed-RL's handlers (`R1AlpacaStyleInstructionHandler`, ...) turning a raw row into texts.
- `preprocess`: the parallel run writing `{output_prefix}_packed_{field}_document.{bin,idx}`;
  `indexed_output`: the atomic Megatron indexed-dataset output it writes through.
- `synthetic`: arithmetic prompt sets for the demo, tests and benchmarks.
- `cli`: `rlfabric preprocess`.

The coordinator reads the output with its own `services/coordinator/prompt_loader.py`.

Modules import torch/megatron/transformers lazily so the CLI's `--help` stays fast.
"""

from services.common.errors import DataError

__all__ = ["DataError"]
