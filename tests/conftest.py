"""Shared fixtures: a private cache for built-in models/data, a tiny model, one Ray per session."""
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Environment for every process the tests start (Ray workers inherit it).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Ray workers must import `tests.reward_fns`.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# As in every rank: DeepSpeed imported here (in-process SFT, fork-server ranks) leaves mlflow out,
# transformers leaves scikit-learn out.
from roll_gspo.utils.imports import lighter_imports  # noqa: E402

lighter_imports()


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """Built-in models and data sets under a per-session cache (not ~/.cache)."""
    cache = os.environ.get("ROLL_GSPO_TEST_CACHE") or str(tmp_path_factory.mktemp("roll_gspo_cache"))
    os.environ["ROLL_GSPO_CACHE"] = cache
    return cache


@pytest.fixture(scope="session")
def tiny_model(session_cache):
    """A random-init tiny Qwen2 (head_dim 32) with the char tokenizer, built in this test session."""
    from roll_gspo.builtin.models import build_base_model

    return build_base_model(os.path.join(session_cache, "test-model"), seed=0, size="micro")


@pytest.fixture(scope="session")
def ray_session(session_cache):
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_moe_model(session_cache):
    """A random-init micro Qwen3-MoE (2 layers, 4 experts, top-2, head_dim 32), char tokenizer."""
    from roll_gspo.builtin.models import build_base_moe_model

    return build_base_moe_model(os.path.join(session_cache, "test-moe-model"), seed=0, size="micro")


# `make test` (scripts/run_tests.sh) runs the suite as two pytest processes at once: the tests marked
# `serial` one after the other at normal priority, the rest beside them at the lowest (nice 19), on
# the CPU the first leaves idle. An end-to-end run keeps the 2 cores ~87 % busy (cpuacct of the PPO
# critic test: 73 CPU-s in 42 s), a unit test one core at most. Serial: the end-to-end and chaos
# tests, and the files whose tests kill, hang or time processes (their deadlines assume a fair share
# of the CPU).
SERIAL_FILES = {"test_code_sandbox.py", "test_reward_workers.py", "test_cluster.py", "test_scale_out.py",
                "test_console.py", "test_engine_loop.py", "test_endpoint.py", "test_endpoint_ray.py",
                "test_llm_judge.py", "test_ifeval.py", "test_envs.py", "test_agentic.py", "test_trackers.py",
                "test_fault_tolerance.py"}


def pytest_itemcollected(item):
    if item.get_closest_marker("e2e") or item.get_closest_marker("chaos") or item.path.name in SERIAL_FILES:
        item.add_marker(pytest.mark.serial)
