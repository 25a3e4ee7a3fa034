"""Session-wide fixtures: the repo, shared data, one private Redis, one tiny model, the one vLLM engine and
its server, starting trainer groups, and the prompt set of whole-system runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: a red CI names a real counterexample, not a lucky draw.
# `make soak` runs the long fuzzing with its own seeds.
settings.register_profile("rlfabric", derandomize=True)
settings.load_profile("rlfabric")

# Several services share 2 cores in CI: one torch thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _pin_mkl_for_this_process() -> None:
    """MKL's batch-invariant AVX2 code path for the test process only (MKL reads MKL_CBWR once, when it starts).

    The stored float64 fixtures of the parity tests (verl, MindSpeed-RL) were made on that path, and AVX-512's
    exp/log and matmul differ in the last bit; the in-process vLLM engine then behaves as `rlfabric.deterministic`
    makes a rollout behave (services/common/determinism.py). The services the tests start keep MKL's native path
    (it is ~1.6x faster), so the variable leaves the environment once MKL has read it.
    """
    from services.common.determinism import MKL_BATCH_INVARIANT

    if "MKL_CBWR" in os.environ:
        return
    os.environ.update(MKL_BATCH_INVARIANT)
    import torch

    torch.ones(8, 8) @ torch.ones(8, 8)  # MKL starts here and reads its path
    torch.exp(torch.ones(64, dtype=torch.float64))
    del os.environ["MKL_CBWR"]


_pin_mkl_for_this_process()

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = (REPO_ROOT / ".." / "shared" / "data").resolve()
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path}: the repo must sit beside shared/")
    return path


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from services.common.redis_store import start_private_redis

    server = start_private_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (configs/model/tiny_qwen3_moe.yaml: 8 experts, top-2), with tiny_model_dir's tokenizer."""
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_moe") / "model", family="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 (configs/model/tiny_deepseek_v3.yaml: MLA, first layer dense, 8 routed + 1 shared
    experts, sigmoid group-limited top-2 with expert bias), with tiny_model_dir's tokenizer."""
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_deepseek") / "model", family="deepseek_v3")


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Qwen3-MoE folders with the same names and other values (weights of seeds 0 and 1, one tokenizer);
    an untied LM head makes greedy continuations more than a copy of the last prompt token."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.common.tiny_model import write_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe_pair")
    first = write_tiny_model(root / "seed0", family="qwen3_moe", seed=0, tie_word_embeddings=False)
    second = Path(shutil.copytree(first, root / "seed1"))
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(first)).float().save_pretrained(second)
    return first, second


@pytest.fixture(scope="session")
def moe_engine(moe_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """The one MoE vLLM engine of a test run, serving `moe_dirs[0]` with routed-experts capture on. As with
    `rollout_engine`, a test that pushes weights puts seed 0's back and uses `weights_version + 1`."""
    pytest.importorskip("vllm")
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    engine = RolloutEngine(EngineOptions(
        model=str(moe_dirs[0]), dtype="float32", tensor_parallel_size=1, max_model_len=256, max_num_seqs=16,
        num_threads=1, cpu_kv_cache_gib=1, cache_root=str(tmp_path_factory.mktemp("vllm_moe_cache")),
        return_routed_experts=True,
    ))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def deepseek_dirs(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny DeepSeek-V3 (seed 0) and a copy with other weights (seed 1, expert bias drawn as write_tiny_model's)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    second = Path(shutil.copytree(tiny_deepseek_dir, tmp_path_factory.mktemp("deepseek_seed1") / "model"))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_deepseek_dir)).float()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.02 * torch.randn(buf.shape))
    model.save_pretrained(second)
    shutil.copy(tiny_deepseek_dir / "config.json", second / "config.json")  # keep the routing keys vLLM reads
    return tiny_deepseek_dir, second


@pytest.fixture(scope="session")
def deepseek_engine(deepseek_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """The one DeepSeek-V3 vLLM engine of a test run (slow tests only: about two minutes to build on CPU), serving
    `deepseek_dirs[0]` with routed-experts capture on. As with `moe_engine`, a test that pushes weights puts seed 0's
    back and uses `weights_version + 1`."""
    pytest.importorskip("vllm")
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    engine = RolloutEngine(EngineOptions(
        model=str(deepseek_dirs[0]), dtype="float32", tensor_parallel_size=1, max_model_len=256, max_num_seqs=16,
        num_threads=1, cpu_kv_cache_gib=1, cache_root=str(tmp_path_factory.mktemp("vllm_deepseek_cache")),
        return_routed_experts=True))
    yield engine
    engine.close()


# --- the one vLLM engine of a test run (tests/rollout and tests/weight_sync share it) ----------------------
# Building it is the slow part. A test that changes its state (weights, sleep) puts it back before it
# returns: every test may assume the weights of `tiny_model_dir` (at some version) and an awake engine.
# Weights versions only move forward, so a test that pushes weights uses `rollout_engine.weights_version + 1`.


@pytest.fixture(scope="session")
def rollout_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("vllm")
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    engine = RolloutEngine(EngineOptions(
        model=str(tiny_model_dir), dtype="float32", tensor_parallel_size=1, max_model_len=256, max_num_seqs=32,
        num_threads=1, cpu_kv_cache_gib=1, gpu_memory_utilization=0.2,
        cache_root=str(tmp_path_factory.mktemp("vllm_cache")),
    ))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def rollout_server(rollout_engine) -> Iterator:
    """(server, servicer) over the shared engine; more servers may share it (several push targets)."""
    from services.rollout.options import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, servicer = create_rollout_server(rollout_engine, SamplingOptions(max_tokens=16, temperature=1.0),
                                             metrics_port=0)
    server.start()
    yield server, servicer
    server.stop(0)


@pytest.fixture()
def rollout_stub(rollout_server) -> Iterator:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    server, _ = rollout_server
    channel = make_channel(server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()


@pytest.fixture(autouse=True)
def _server_security_restored() -> Iterator[None]:
    """A serve command run in-process sets this process's server security (a fail-closed token without
    --auth-token-file); the next test's in-process servers must not inherit it."""
    from services.common import credentials

    before = credentials.server_credentials()
    yield
    credentials.set_server_credentials(before)


# --- trainer groups: real `rlfabric trainer serve` processes (services/common/processes.py) --------------


@pytest.fixture(scope="session")
def start_trainer(tmp_path_factory: pytest.TempPathFactory):
    """`start_trainer(*serve_args)` -> (group process, rank 0's address); every group is stopped at the end."""
    from services.common.processes import start_trainer_group, stop_all

    started = []

    def start(*args: str):
        log_dir = tmp_path_factory.mktemp("trainer_group")
        group, address = start_trainer_group(
            log_dir, [*args, "--grace-s", "5", "--insecure"], timeout_s=300,  # the tests call without a token
            env={"PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
        started.append(group)
        return group, address

    yield start
    # A trainer rank gets 10 s (its server's drain) after SIGTERM; one still there then is killed rather than
    # waited for: 30 s here once cost the session's teardown that much, waiting on a rank stuck in a fuzzed call.
    stop_all(started, grace_s=12)


# --- the prompt set of whole-system runs (tests/e2e, tests/reliability) --------------------------------


@pytest.fixture(scope="session")
def arith_prefix(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """64 "What is A + B? The answer is" prompts (W1's form) with their sums as labels, preprocessed."""
    from services.data.synthetic import write_arithmetic_jsonl
    from tests.preprocessing import preprocess_jsonl

    root = tmp_path_factory.mktemp("arith")
    write_arithmetic_jsonl(root / "arith.jsonl", 64)
    return preprocess_jsonl(repo_root, root / "arith.jsonl", tiny_model_dir, root / "data" / "arith")
