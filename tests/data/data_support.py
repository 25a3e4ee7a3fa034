"""Constants and helpers shared by the data tests (imported by name: tests/data has no package)."""

from __future__ import annotations

from pathlib import Path

from services.data.dataset_config import DatasetConfig

DEEPSCALER_803 = "deepscaler/deepscaler_subset803_meta-reason.json"
DEEPSCALER_MATH_7474 = "deepscaler/deepscaler_component_train_math.json"
DAPO_106 = "dapo/dapo-math-17k_first106rows.parquet"

# qwen_r1 as MindSpeed-RL's templates.json spells it: the ChatML frame with the default system message and
# the R1-Zero instruction before the problem, ending with the assistant header.
R1_FRAME_HEAD = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. Put your final "
    "answer within \\boxed{}.\n"
)
R1_FRAME_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


def deepscaler_config(shared_data: Path, tiny_model_dir: Path, prefix: Path, **kw) -> DatasetConfig:
    """configs/datasets/deepscaler.yaml's values, with the input, tokenizer and output moved for the test."""
    values = dict(
        input=str(shared_data / DEEPSCALER_803),
        tokenizer_name_or_path=str(tiny_model_dir),
        output_prefix=str(prefix),
        handler_name="R1AlpacaStyleInstructionHandler",
        tokenizer_type="HuggingFaceTokenizer",
        workers=1,
        log_interval=1000,
        prompt_type="qwen_r1",
        map_keys={"prompt": "problem", "query": "", "response": "answer", "system": ""},
        dataset_additional_keys=["labels"],
    )
    values.update(kw)
    return DatasetConfig(**values)
