"""Hugging Face <-> Megatron-core checkpoint conversion (the folder-level `rlfabric convert` commands).

Owns reading and writing HF folders and Megatron release checkpoints, and the in-memory state-dict
conversions `hf_to_mcore` / `mcore_to_hf`. The name and layout mapping itself (fused QKV per query group,
[gate; up], vocabulary padding, TP split dims, PP renumbering, tied embeddings, experts over EP ranks) lives
in services/common/weight_layout.py, shared with the weight-sync resharding plan. The conversion is pure
slicing and concatenation, so HF -> mcore -> HF is bitwise exact. Uneven pipeline stages (MindSpeed's
num_layer_list / noop_layers, `stage_layers_of_model`) are written with each stage's layers numbered from 0 and
recorded beside the weights; mcore2hf reads them from the files themselves. With expert parallelism (`ep` > 1, a
Qwen3-MoE or DeepSeek-V3 model) every (tp, pp, ep) rank gets its own folder, as Megatron writes them (ckpt_layout.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from services.common import pipeline_layout, tensor_recipes, weight_layout
from services.common.model_spec import ModelSpec, read_hf_config
from services.trainer import ckpt_layout

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
ShardKey = tensor_recipes.ShardKey  # (tp_rank, pp_rank, ep_rank)
layers_of_stage = weight_layout.layers_of_stage
StageLayers = weight_layout.StageLayers


def _noop(_msg: str) -> None:
    pass


def _layer_progress(spec: ModelSpec, progress: Progress, arrow: str) -> Callable[[tensor_recipes.TensorRecipe], None]:
    """Report "layer L/N <arrow> pp_rank p" once a layer's last tensor is done."""
    per = spec.num_hidden_layers
    last_of_layer: dict[int, str] = {}

    def report(r: tensor_recipes.TensorRecipe) -> None:
        if r.layer is None:
            return
        if not last_of_layer:
            for rr in weight_layout.recipes(spec, 1, 1):
                if rr.layer is not None:
                    last_of_layer[rr.layer] = rr.hf_name
        if last_of_layer[r.layer] == r.hf_name:
            progress(f"layer {r.layer + 1}/{per} {arrow} pp_rank {r.sources[0].pp_rank}")

    return report


def hf_to_mcore(
    hf: dict[str, torch.Tensor], spec: ModelSpec, tp: int, pp: int, progress: Progress = _noop,
    only: Sequence[int] | None = None, *, ep: int = 1, stages: StageLayers | None = None,
) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Split an HF state dict into Megatron state dicts keyed by (tp_rank, pp_rank, ep_rank).

    `only` = (tp_rank, pp_rank[, ep_rank]) builds just that rank's dict (what a trainer rank loads), returned
    under `only` as given. `stages`: the layers of each pipeline stage (None: an even split).
    """

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint lacks {name!r} (model_type={spec.model_type}); is the folder complete?")
        return hf[name]

    shards = tensor_recipes.to_mcore(weight_layout.recipes(spec, tp, pp, ep, stages), take, only=only,
                                    on_recipe=_layer_progress(spec, progress, "->"))
    if only is not None:
        return {tuple(only): shards.get(tensor_recipes.shard_key(only), {})}
    return {(t, p, e): shards.get((t, p, e), {}) for t in range(tp) for p in range(pp) for e in range(ep)}


def mcore_to_hf(
    shards: Mapping[Sequence[int], dict[str, torch.Tensor]], spec: ModelSpec, tp: int, pp: int,
    progress: Progress = _noop, *, ep: int = 1, stages: StageLayers | None = None,
) -> dict[str, torch.Tensor]:
    """Merge Megatron rank state dicts (keyed by (tp_rank, pp_rank[, ep_rank])) into one HF state dict.

    `stages`: the layers of each pipeline stage; None: what the state dicts hold (`stored_stage_layers`)."""
    report = _layer_progress(spec, progress, "<-")
    by_key = {tensor_recipes.shard_key(k): sd for k, sd in shards.items()}
    if stages is None:
        stages = stored_stage_layers(by_key, pp)
    hf: dict[str, torch.Tensor] = {}

    def fetch(s: tensor_recipes.ShardSlice) -> torch.Tensor:
        if s.key not in by_key:
            raise KeyError(f"no state dict for {s.rank_text} (the layout is TP={tp} PP={pp} EP={ep})")
        if s.name not in by_key[s.key]:
            raise KeyError(f"{s.name!r} is missing from the state dict of {s.rank_text}")
        return by_key[s.key][s.name]

    for r, tensor in tensor_recipes.to_hf(weight_layout.recipes(spec, tp, pp, ep, stages), fetch):
        hf[r.hf_name] = tensor
        report(r)
    return hf


def stored_stage_layers(shards: Mapping[ShardKey, Mapping[str, object]], pp: int) -> tuple[int, ...] | None:
    """The layers of each pipeline stage as the state dicts of TP rank 0, EP rank 0 hold them (None when one is
    absent)."""
    if any((0, p, 0) not in shards for p in range(pp)):
        return None
    return weight_layout.stage_layers_of_names([shards[(0, p, 0)] for p in range(pp)])


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's safetensors files (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files (convert .bin checkpoints to safetensors first)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def save_hf_state(state: dict[str, torch.Tensor], out_dir: Path) -> Path:
    from safetensors.torch import save_file

    out = out_dir / "model.safetensors"
    save_file({k: t.contiguous() for k, t in state.items()}, str(out), metadata={"format": "pt"})
    return out


def convert_hf_to_mcore(
    hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, progress: Progress = _noop,
    num_layer_list: str | None = None, noop_layers: str | None = None,
) -> Path:
    """Write `{out_dir}/release/mp_rank_*/model_optim_rng.pt` (+ tracker, hf_assets); return the root.

    `num_layer_list` / `noop_layers`: MindSpeed's uneven pipeline stages (their YAML keys' values; noop_layers
    indices count the no-op layers, whose number is added to the model's layers as Megatron's num_layers)."""
    from services.trainer.model import transformer_config  # validates tp/pp against the model

    t0 = time.monotonic()
    hf_dir, root = Path(hf_dir), Path(out_dir)
    spec, raw = read_hf_config(hf_dir)
    stages = stage_layers_of_flags(spec, pp, num_layer_list, noop_layers)
    transformer_config(spec, tp=tp, pp=pp, stages=stages)
    weight_layout.recipes(spec, tp, pp, ep, stages)  # refuses an EP size that does not fit before any reading
    progress(f"read {hf_dir} ({spec.model_type}, {spec.num_hidden_layers} layers"
             + (f", {list(stages)} per pipeline stage)" if len(set(stages)) > 1 else ")"))
    shards = hf_to_mcore(load_hf_state(hf_dir), spec, tp, pp, progress, ep=ep, stages=stages)
    root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_layout.tmp_iter_dir(root, ckpt_layout.RELEASE)
    for (t, p, e), sd in sorted(shards.items()):
        path = ckpt_layout.shard_path(tmp, t, p, pp, e, ep)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(release_payload(sd, raw, tp, pp, ep, stages), path)
        progress(f"wrote {path.parent.name}")
    ckpt_layout.copy_hf_assets(hf_dir, root / ckpt_layout.HF_ASSETS)
    ckpt_layout.commit_iter_dir(root, ckpt_layout.RELEASE)
    progress(f"done in {time.monotonic() - t0:.1f}s: {root}")
    return root


def stage_layers_of_flags(spec: ModelSpec, pp: int, num_layer_list: str | None = None,
                          noop_layers: str | None = None) -> tuple[int, ...]:
    """The model's layers per pipeline stage that --num-layer-list / --noop-layers describe (even without them);
    ValueError naming the flag."""
    try:
        stages = pipeline_layout.stage_layers_of_model(spec.num_hidden_layers, pp, num_layer_list, noop_layers)
    except pipeline_layout.StageLayoutError as e:
        flag = {"pipeline_model_parallel_size": "--pp"}.get(e.key, f"--{e.key.replace('_', '-')}")
        raise ValueError(f"{flag}: {e}") from None
    return weight_layout.stage_layer_counts(spec, pp, stages)


def release_payload(sd: dict[str, torch.Tensor], hf_config: dict, tp: int, pp: int, ep: int = 1,
                    stages: StageLayers | None = None) -> dict:
    return {
        "model": sd,
        "checkpoint_version": 3.0,
        "iteration": 0,
        "rlfabric": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "expert_model_parallel_size": ep, "hf_config": hf_config,
                     **({} if stages is None else {"stage_layers": list(stages)})},
    }


def read_shards(
    iter_dir: Path, progress: Progress = _noop
) -> tuple[dict[ShardKey, dict[str, torch.Tensor]], dict, int, int, int]:
    """Model state dicts of every rank in a checkpoint iteration dir, the stored HF config, TP, PP and EP."""
    tp, pp, ep = ckpt_layout.detect_tp_pp_ep(iter_dir)
    shards, hf_config = {}, None
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                path = ckpt_layout.shard_path(iter_dir, t, p, pp, e, ep)
                if not path.is_file():
                    raise FileNotFoundError(f"{path} missing (the other folders say TP={tp} PP={pp} EP={ep})")
                payload = torch.load(path, map_location="cpu", weights_only=False)
                shards[(t, p, e)] = payload["model"]
                hf_config = hf_config or payload.get("rlfabric", {}).get("hf_config")
                progress(f"read {path.parent.name}")
    return shards, hf_config, tp, pp, ep


def convert_mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    *,
    iteration: int | None = None,
    hf_assets: str | Path | None = None,
    progress: Progress = _noop,
    num_layer_list: str | None = None,
    noop_layers: str | None = None,
) -> Path:
    """Write a complete HF folder (config, model.safetensors, tokenizer) from a Megatron checkpoint.

    The layers of each pipeline stage are what the files hold; `num_layer_list` / `noop_layers`, when given, must
    describe the same layout."""
    import json

    from services.common.model_spec import read_config_json, spec_from_hf_config

    t0 = time.monotonic()
    root, out = Path(mcore_dir), Path(out_dir)
    iter_dir, _ = ckpt_layout.resolve_iter_dir(root, iteration)
    assets = Path(hf_assets) if hf_assets else root / ckpt_layout.HF_ASSETS
    shards, hf_config, tp, pp, ep = read_shards(iter_dir, progress)
    if hf_config is None:
        cfg_path = assets / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{iter_dir}: no HF config stored and no {cfg_path}; pass --hf-assets HF_DIR")
        hf_config = read_config_json(assets)
    spec = spec_from_hf_config(hf_config, source=str(iter_dir))
    stages = stored_stage_layers(shards, pp)
    if num_layer_list is not None or noop_layers is not None:
        asked = stage_layers_of_flags(spec, pp, num_layer_list, noop_layers)
        if asked != stages:
            raise ValueError(f"{iter_dir} holds {list(stages or ())} layers per pipeline stage, but --num-layer-list "
                             f"{num_layer_list!r} / --noop-layers {noop_layers!r} describe {list(asked)}")
    hf = mcore_to_hf(shards, spec, tp, pp, progress, ep=ep, stages=stages)
    out.mkdir(parents=True, exist_ok=True)
    if assets.is_dir():
        ckpt_layout.copy_hf_assets(assets, out)
    else:
        progress(f"warning: {assets} missing, writing config.json only (no tokenizer)")
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_hf_state(hf, out)
    progress(f"done in {time.monotonic() - t0:.1f}s: {out}")
    return out
