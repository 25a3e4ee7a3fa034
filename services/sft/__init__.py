"""`rlfabric sft`: a short supervised warm-up of a small HF model on (prompt, answer) rows, before GRPO."""
