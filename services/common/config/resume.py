"""Whether a run resumes a trained checkpoint, and the rule that such a resume names its reference weights.

MindSpeed-RL treats `finetune: false` as "continue from `load`": with a freshly converted checkpoint
(Megatron's tracker `latest_checkpointed_iteration.txt` says `release` or 0, or there is none yet) that is a
first run, and the reference loads the same initial weights. Only a checkpoint past iteration 0 holds a
trained actor; resuming it without separate reference weights would make the trained actor the reference
(a MindSpeed-RL defect, parity.md), so that case is refused, except under LoRA's `share_backbone`, where the
reference is the frozen backbone itself. The checkpoint is read from the file system at
load time; a `load` that does not exist yet (a config checked on another machine) is a first run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig
# Megatron's checkpoint layout: the tracker names the latest iteration ("123" or "release").
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def checkpoint_iteration(load: str | Path | None) -> int | None:
    """The iteration of the Megatron checkpoint under `load`: 0 for `release`, None when there is none."""
    if load is None:
        return None
    root = Path(load)
    tracker = root / TRACKER
    try:
        text = tracker.read_text().strip() if tracker.is_file() else None
    except OSError:
        text = None
    if text is not None:
        if text == "release":
            return 0
        if text.isdigit():
            return int(text)
    try:
        iterations = [int(m.group(1)) for p in root.iterdir() if (m := _ITER_DIR.match(p.name)) and p.is_dir()]
    except OSError:
        return None
    return max(iterations) if iterations else None


def resume_rule(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, d = cfg.actor_config, cfg.derived
    # No reference trainer: no KL term, or LoRA's share_backbone (the reference is the frozen backbone itself).
    if a.finetune or a.load is None or not d.reference_trainer:
        return
    iteration = checkpoint_iteration(a.load)
    if iteration is None or iteration == 0:
        return  # a converted checkpoint (or none yet): a first run, the reference loads the same weights
    if d.ref_model_load_path is None or d.ref_model_load_path == a.load:
        where = ("`rl_config.integrated_mode_config.ref_model_load_path`" if cfg.rl_config.use_integrated_worker
                 else "`ref_config.load` (or `rl_config.integrated_mode_config.ref_model_load_path`)")
        yield Problem(("finetune", "load"),
                      f"you resume (finetune: false) from load `{a.load}`, a checkpoint trained to iteration "
                      f"{iteration}, but no separate reference weights are given, so the reference would load the "
                      f"trained actor; set {where} to the original weights ({_original(cfg)}), or set finetune: "
                      f"true to start a new run")


def _original(cfg: RLFabricConfig) -> str:
    """What the reference can load: the HF folder the run started from serves, converted in memory (no second
    conversion into another folder)."""
    hf = cfg.actor_config.tokenizer_name_or_path
    return f"e.g. the Hugging Face folder {hf or 'the run started from'}, which the trainer converts in memory"
