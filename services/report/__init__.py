"""Reports of a finished or running run: `rlfabric plot` (charts from the metrics JSONL)."""
