"""The seed's quick start as docs/quickstart.md writes it (preprocess_data.sh -> the hf2mcore script -> the trainer
script -> resume with `finetune: false` -> the mcore2hf script), scaled to the tiny model, in a scratch checkout
whose paths are the docs' (./dataset/deepscaler.json, ./Qwen2.5-7B, ./model_from_hf/qwen25-7b, ./ckpt).

Every command run here is checked to appear verbatim in docs/quickstart.md; the tiny sizes are appended to it.
The default part (about 40 s) preprocesses real DeepScaleR rows, converts, checks the config and sees `rlfabric up`
refuse before the inputs exist; the two training runs, the resume and the conversion back are `slow` (soak, about
3 minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_grpo_run import SEED_METRICS

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = (REPO / "docs" / "quickstart.md").read_text()
DEEPSCALER = "deepscaler/deepscaler_subset803_meta-reason.json"

LINK = "mkdir -p model_from_hf && ln -s ../Qwen2.5-7B model_from_hf/qwen25-7b"
PREPROCESS = "bash examples/data/preprocess_data.sh deepscaler"
HF2MCORE = "bash examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh"
MCORE2HF = "bash examples/ckpt/ckpt_convert_qwen25_mcore2hf.sh"
CHECK = "rlfabric config check configs/grpo_qwen25_7b_A3.yaml --require-files"
TRAIN = "bash examples/grpo/grpo_trainer_qwen25_7b.sh"
RESUME = ("bash examples/grpo/grpo_trainer_qwen25_7b.sh actor_config.finetune=false actor_config.no_load_optim=false "
          "actor_config.no_load_rng=false rl_config.integrated_mode_config.ref_model_load_path=./Qwen2.5-7B")
TINY_CONVERSION = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
                   "--params-dtype", "fp32"]


def tiny_overrides() -> list[str]:
    """The 7B config scaled to the tiny model: its architecture over the qwen25_7b block, one CPU device, sizes."""
    block = yaml.safe_load((REPO / "configs" / "model" / "tiny_qwen2.yaml").read_text())["tiny_qwen2"]
    return [*(f"model.qwen25_7b.{k}={v}" for k, v in block.items()),
            "rl_config.actor_resource.num_npus=1", "actor_config.tensor_model_parallel_size=1",
            "actor_config.pipeline_model_parallel_size=1", "megatron_training.global_batch_size=2",
            "rl_config.mini_batch_size=2", "rl_config.n_samples_per_prompt=4", "rl_config.max_prompt_length=1024",
            "generate_config.max_model_len=2048", "generate_config.max_num_seqs=16",
            "generate_config.sampling_config.max_tokens=32", "megatron_training.train_iters=2",
            "megatron_training.save_interval=2", "megatron_training.bf16=false", "generate_config.dtype=float32"]


def as_flags(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("-o", o)]


def run(checkout: Path, command: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A docs/quickstart.md command as written (checked to be there), with `extra` arguments appended."""
    assert command in QUICKSTART, f"docs/quickstart.md does not show `{command}`"
    argv = shlex.split(command)
    if argv[0] == "rlfabric":
        argv = [sys.executable, "-m", "services.cli", *argv[1:]]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*argv, *extra], cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    (path,) = run_dir.glob("runs/*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory, shared_data: Path, tiny_model_dir: Path) -> Path:
    """A repository root as the page leaves it after its downloads: the data and the model at the docs' paths."""
    root = tmp_path_factory.mktemp("quickstart")
    for name in ("configs", "examples", "cli", "services", "rlfabric"):
        (root / name).symlink_to(REPO / name)
    # Step 2's download: real DeepScaleR rows (the shortest 32 of 803), a JSON array like deepscaler.json.
    rows = json.loads((shared_data / DEEPSCALER).read_text())
    (root / "dataset").mkdir()
    (root / "dataset" / "deepscaler.json").write_text(json.dumps(sorted(rows, key=lambda r: len(r["problem"]))[:32]))
    # Step 3's download: `rlfabric tiny-model ./Qwen2.5-7B` (the session's copy), then the docs' link.
    shutil.copytree(tiny_model_dir, root / "Qwen2.5-7B")
    assert LINK in QUICKSTART
    subprocess.run(["bash", "-c", LINK], cwd=root, check=True)
    return root


@pytest.fixture
def prepared(checkout: Path) -> Path:
    """The checkout after steps 2 and 3 (the default tests below run them and check their output; alone, the
    slow test runs them here)."""
    if not (checkout / "dataset" / "deepscaler" / "data_packed_input_ids_document.idx").is_file():
        assert run(checkout, PREPROCESS, "--set", "workers=1", "--quiet").returncode == 0
    if not (checkout / "ckpt").is_dir():
        assert run(checkout, HF2MCORE, *TINY_CONVERSION).returncode == 0
    return checkout


def test_up_names_every_missing_input_before_starting_anything(checkout: Path) -> None:
    up = run(checkout, TRAIN, *tiny_overrides(), "--run-dir", "runs/refused", timeout=120)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "Traceback" not in up.stderr and not (checkout / "runs").exists()
    assert "megatron_training.data_path: no preprocessed dataset at ./dataset/deepscaler/data" in up.stderr
    assert "run `bash examples/data/preprocess_data.sh deepscaler`" in up.stderr
    assert ("actor_config.load: no folder ./ckpt; convert the Hugging Face model with `rlfabric convert hf2mcore "
            "--tp 1 --pp 1 ./Qwen2.5-7B ./ckpt`") in up.stderr
    # config check lists the same inputs and passes; --require-files (the docs' form) fails on them.
    listed = run(checkout, CHECK.removesuffix(" --require-files"), *as_flags(tiny_overrides()), timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "input paths not here (2; `rlfabric up` stops on them" in listed.stdout
    assert run(checkout, CHECK, *as_flags(tiny_overrides()), timeout=120).returncode == 2


def test_preprocess_writes_where_the_run_config_reads(checkout: Path) -> None:
    out = run(checkout, PREPROCESS, "--set", "workers=1", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "input: ./dataset/deepscaler.json (json_array)\nrows read: 32\nrows written: 32\nrows dropped: 0" in out.stdout
    names = sorted(p.name for p in (checkout / "dataset" / "deepscaler").iterdir())
    assert names == sorted(f"data_packed_{k}_document.{e}" for k in ("input_ids", "attention_mask", "labels")
                           for e in ("bin", "idx"))
    assert not list((checkout / "dataset").glob("data_*"))  # not upstream's ./dataset/data_*, which no config reads


def test_convert_script_checks_upstream_flags_then_writes_the_load_folder(checkout: Path) -> None:
    refused = run(checkout, HF2MCORE, timeout=60)  # the script's --params-dtype bf16: the tiny model is float32
    assert refused.returncode == 2 and not (checkout / "ckpt").exists()
    assert refused.stderr.strip().splitlines() == [
        "cli/convert_ckpt.py: error: --params-dtype bf16: Qwen2.5-7B holds float32 weights and rlfabric's converter "
        "keeps them as they are (the trainer casts them to the run's dtype when it loads), so it cannot round them "
        "to bfloat16 as upstream would; drop the flag or give --params-dtype fp32"]
    out = run(checkout, HF2MCORE, *TINY_CONVERSION)
    assert out.returncode == 0, out.stderr
    assert (checkout / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert [p.name for p in (checkout / "ckpt" / "release").iterdir()] == ["mp_rank_00"]
    check = run(checkout, CHECK, *as_flags(tiny_overrides()), timeout=120)
    assert check.returncode == 0, check.stderr
    assert "model block checked against Qwen2.5-7B/config.json: it matches" in check.stdout
    assert "input paths: every folder and dataset the run reads is here" in check.stdout
    assert check.stdout.splitlines()[-1].startswith("OK: actor DP = 1 (1 devices / TP 1 x PP 1 x CP 1)")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "cli" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_upstream_convert_flags_map_to_rlfabric_convert(tmp_path: Path, tiny_model_dir: Path) -> None:
    convert = _module("convert_ckpt")
    common = ["--use-mcore-models", "--model-type", "GPT", "--model-type-hf", "llama2", "--add-qkv-bias"]
    args = convert._parser().parse_args([*common, "--load-model-type", "hf", "--save-model-type", "mg",
                                         "--target-tensor-parallel-size", "4", "--target-expert-parallel-size", "2",
                                         "--load-dir", str(tiny_model_dir), "--save-dir", "out", "--params-dtype",
                                         "fp32", "--tokenizer-model", str(tiny_model_dir / "tokenizer.json")])
    assert convert.to_rlfabric(args) == ["convert", "hf2mcore", "--tp", "4", "--pp", "1", "--ep", "2",
                                         str(tiny_model_dir), "out"]
    # mg -> hf into the original HF folder writes its mg2hf/ (upstream's layout), elsewhere a whole HF folder.
    back = [*common, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", "ckpt"]
    assert convert.to_rlfabric(convert._parser().parse_args([*back, "--save-dir", str(tiny_model_dir)])) == [
        "convert", "mcore2hf", "ckpt", str(tiny_model_dir / "mg2hf"), "--hf-assets", str(tiny_model_dir)]
    assert convert.to_rlfabric(convert._parser().parse_args([*back, "--save-dir", str(tmp_path / "new")])) == [
        "convert", "mcore2hf", "ckpt", str(tmp_path / "new")]
    wrong = convert._parser().parse_args([*common[:4], "qwen3", "--load-model-type", "hf", "--save-model-type",
                                          "mg", "--load-dir", str(tiny_model_dir), "--save-dir", "out"])
    assert convert.to_rlfabric(wrong) == (f"--model-type-hf qwen3 converts qwen3 models; {tiny_model_dir}/config.json "
                                          f"says 'qwen2'")
    no_bias = convert._parser().parse_args([*common[:5], "--load-model-type", "hf", "--save-model-type", "mg",
                                            "--load-dir", str(tiny_model_dir), "--save-dir", "out"])
    assert "has a q/k/v bias: add --add-qkv-bias" in convert.to_rlfabric(no_bias)
    for argv, message in ((["--num-layer-list", "1,1"], "--num-layer-list is not supported by rlfabric's converter"),
                          (["--save-model-type", "mg"], "--load-model-type mg --save-model-type mg: rlfabric converts")):
        out = subprocess.run([sys.executable, "cli/convert_ckpt.py", *back, "--save-dir", "x", *argv], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and message in out.stderr, out.stderr


def test_upstream_train_entry_maps_hydra_arguments_to_up() -> None:
    train = _module("train_grpo")
    argv = train.to_up_argv(["--config-name", "grpo_qwen25_7b_A3", "actor_config.lr=2e-6", "--run-dir", "r",
                             "-o", "rl_config.clip_ratio=0.3"])
    assert argv[0] == "up" and Path(argv[1]).resolve() == REPO / "configs" / "grpo_qwen25_7b_A3.yaml"
    assert argv[2:] == ["-o", "actor_config.lr=2e-6", "-o", "rl_config.clip_ratio=0.3", "--run-dir", "r"]
    assert train.to_up_argv(["-cn=grpo_tiny_cpu"])[1].endswith("grpo_tiny_cpu.yaml")
    assert train.to_up_argv(["actor_config.lr=1"]).startswith("--config-name NAME is required")
    assert "no file" in train.to_up_argv(["--config-name", "grpo_trainer_qwen25_7b_A3"])  # upstream script's typo
    assert train.to_up_argv(["--config-name", "x", "+rl_config.new=1"]).startswith("+rl_config.new=1: Hydra's")


@pytest.mark.slow
def test_the_trainer_script_trains_then_resumes_upstream_style(prepared: Path) -> None:
    """Two iterations from the converted checkpoint, then the docs' resume to three: load = save = ./ckpt."""
    checkout = prepared
    first = run(checkout, TRAIN, *tiny_overrides(), "--run-dir", "runs/first", timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ms = metrics(checkout / "runs" / "first")
    assert [m["iteration"] for m in ms] == [1, 2]
    assert not [k for k in SEED_METRICS if k not in ms[-1]]
    assert (checkout / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    resumed = [*tiny_overrides(), "megatron_training.train_iters=3"]
    no_reference = RESUME.rsplit(" ", 1)[0]  # without the original weights for the reference: refused at once
    refused = run(checkout, no_reference, *resumed, "--run-dir", "runs/refused", timeout=120)
    assert refused.returncode == 2 and not (checkout / "runs" / "refused").exists()
    assert "a checkpoint trained to iteration 2" in refused.stderr
    assert "the Hugging Face folder ./Qwen2.5-7B, which the trainer converts in memory" in refused.stderr

    second = run(checkout, RESUME, *resumed, "--run-dir", "runs/second", timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    (m,) = metrics(checkout / "runs" / "second")
    assert (m["iteration"], m["data/consumed_batches"]) == (3, 3)  # the actor's iteration and the data cursor
    assert (checkout / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (checkout / "ckpt" / "release").is_dir()  # the converted weights, never converted again

    back = run(checkout, MCORE2HF, timeout=300)
    assert back.returncode == 0, back.stderr
    hf = checkout / "Qwen2.5-7B" / "mg2hf"
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen2"
    from safetensors.torch import load_file

    trained, original = load_file(hf / "model.safetensors"), load_file(checkout / "Qwen2.5-7B" / "model.safetensors")
    assert trained.keys() == original.keys()
    assert all(trained[k].shape == original[k].shape for k in original)
