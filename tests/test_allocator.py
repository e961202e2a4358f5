"""`memory_allocator`: which malloc the model roles' Ray workers start with."""
from __future__ import annotations

import logging
import os

import pytest

from roll_gspo.config import ConfigError, load_config
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.allocator import JEMALLOC_CONF, allocator_env, bundled_jemalloc
from roll_gspo.distributed.cluster import worker_env


def test_choices_and_what_each_sets(tmp_path):
    library = str(tmp_path / "libjemalloc.so")
    wanted = {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}
    assert allocator_env("auto", on_gpu=False, library=library, inherited_preload="") == wanted
    assert allocator_env("jemalloc", on_gpu=True, library=library, inherited_preload="") == wanted
    assert allocator_env("auto", on_gpu=True, library=library, inherited_preload="") == {}  # not measured on GPUs
    assert allocator_env("system", on_gpu=False, library=library, inherited_preload="") == {}
    with pytest.raises(ValueError, match="memory_allocator='tcmalloc'"):
        allocator_env("tcmalloc", on_gpu=False)


def test_auto_keeps_the_system_malloc_for_a_large_policy_on_cpu(tmp_path, monkeypatch):
    """jemalloc without decay grew a 0.5B training rank without bound (docs/benchmarks.md): `auto`
    picks it only below AUTO_JEMALLOC_MAX_PARAMETERS; an explicit `jemalloc` is the user's (and the
    host plan refuses it at that size, tests/test_host_memory.py)."""
    from roll_gspo.utils.allocator_choice import AUTO_JEMALLOC_MAX_PARAMETERS

    library = str(tmp_path / "libjemalloc.so")
    wanted = {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}
    big, small = AUTO_JEMALLOC_MAX_PARAMETERS, AUTO_JEMALLOC_MAX_PARAMETERS - 1
    assert allocator_env("auto", on_gpu=False, library=library, inherited_preload="", parameters=big) == {}
    assert allocator_env("auto", on_gpu=False, library=library, inherited_preload="", parameters=small) == wanted
    assert allocator_env("jemalloc", on_gpu=False, library=library, inherited_preload="", parameters=big) == wanted
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    if bundled_jemalloc() is None:
        pytest.skip("this Ray wheel bundles no libjemalloc.so")
    cfg = load_config("example_gspo_0.5b_cpu.yaml", ["memory_allocator=auto"])  # the built-in 0.5B shape, not built
    assert "LD_PRELOAD" not in worker_env(cfg, cfg.actor_train)
    assert worker_env(load_config("example_gspo.yaml"), cfg.actor_train)["LD_PRELOAD"] == bundled_jemalloc()


def test_a_preload_the_user_set_is_kept(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="roll_gspo.allocator"):
        env = allocator_env("jemalloc", on_gpu=False, library=str(tmp_path / "j.so"),
                            inherited_preload="/opt/libtcmalloc.so")
    assert env == {}
    assert "LD_PRELOAD=/opt/libtcmalloc.so is already set" in caplog.text


def test_without_a_bundled_jemalloc_the_run_says_so(monkeypatch, caplog):
    import roll_gspo.distributed.allocator as allocator

    monkeypatch.setattr(allocator, "bundled_jemalloc", lambda: None)
    monkeypatch.setattr(allocator, "_said", set())
    with caplog.at_level(logging.WARNING, logger="roll_gspo.allocator"):
        assert allocator_env("auto", on_gpu=False, inherited_preload="") == {}
        assert allocator_env("auto", on_gpu=False, inherited_preload="") == {}
    assert caplog.text.count("no bundled libjemalloc.so") == 1  # each role asks; said once


def test_the_key_is_checked_and_reaches_model_roles_only(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(ConfigError, match="memory_allocator"):
        load_config("example_gspo.yaml", ["memory_allocator=tcmalloc"])
    cfg = PipelineConfig()
    if bundled_jemalloc() is None:
        pytest.skip("this Ray wheel bundles no libjemalloc.so")
    assert worker_env(cfg, cfg.actor_train)["LD_PRELOAD"] == bundled_jemalloc()
    assert "LD_PRELOAD" not in worker_env(cfg)  # reward workers (and their sandboxes) keep the system malloc
    cfg.actor_train.num_gpus_per_worker = 1.0
    assert "LD_PRELOAD" not in worker_env(cfg, cfg.actor_train)  # auto: GPU roles keep it too
    cfg.actor_infer.system_envs = {"LD_PRELOAD": "/opt/other.so"}
    assert worker_env(cfg, cfg.actor_infer)["LD_PRELOAD"] == "/opt/other.so"  # system_envs win
    assert "LD_PRELOAD" not in worker_env(PipelineConfig(memory_allocator="system"), cfg.reference)


def test_a_model_role_worker_runs_on_jemalloc(ray_session, monkeypatch):
    """The library is mapped into the worker's process (LD_PRELOAD has to be there at exec)."""
    import ray

    from roll_gspo.distributed.cluster import Cluster, RankWorker

    if bundled_jemalloc() is None:
        pytest.skip("this Ray wheel bundles no libjemalloc.so")
    monkeypatch.delenv("LD_PRELOAD", raising=False)

    class MapsProbe(RankWorker):
        def libraries(self):
            return open("/proc/self/maps").read(), os.environ.get("MALLOC_CONF")

    cfg = PipelineConfig()
    for choice, expected in (("auto", True), ("system", False)):
        cfg.memory_allocator = choice
        cluster = Cluster(f"maps_probe_{choice}", MapsProbe, 1, 0.1, 0, env=worker_env(cfg, cfg.actor_train))
        try:
            maps, conf = ray.get(cluster.workers[0].libraries.remote())
            assert ("libjemalloc" in maps) is expected, choice
            assert (conf == JEMALLOC_CONF) is expected, choice
        finally:
            cluster.shutdown()
