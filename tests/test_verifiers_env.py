"""verifiers environments train unchanged through the rollout endpoint
(`agent.verifiers_env`): a small multi-turn env made from verifiers' own classes
(tests/vf_envs/vf_two_turns.py) plays its episodes through the run's endpoint, each trace's turns
one record (verifiers' X-Session-ID), the rubric's reward the episode's. Bad values are refused at
load, naming the key."""
import os
import sys

import pytest
import torch

from roll_gspo.config import ConfigError

from tests.test_agentic_e2e import records
from tests.test_endpoint_run import agent_config

pytest.importorskip("verifiers.v1", reason="verifiers is not installed: pip install 'verifiers==0.4.0' "
                                           "(make install installs it with the cpu extra)")
ENVS = os.path.join(os.path.dirname(__file__), "vf_envs")
VF_ENV = {"taskset": {"id": "vf_two_turns"}, "agent": {"runtime": {"type": "subprocess"}}}


@pytest.fixture(autouse=True)
def env_path(monkeypatch):
    monkeypatch.syspath_prepend(ENVS)


def verifiers_config(tmp_path, model, **changes):
    return agent_config(tmp_path, model, agent={"agent_func": None, "task_file": None, "verifiers_env": VF_ENV},
                        **changes)


@pytest.mark.parametrize("env,extra,message", [
    ({"taskset": {"id": "no_such_taskset"}}, {}, "no_such_taskset"),
    ({"agent": {}}, {}, "needs taskset.id"),
    ({**VF_ENV, "agent": {"harness": {"id": "no_such_harness"}}}, {}, "no_such_harness"),
    ({**VF_ENV, "no_such_field": 1}, {}, "no_such_field"),
    (VF_ENV, {"task_file": "tasks.jsonl"}, "the verifiers taskset gives the tasks"),
    (VF_ENV, {"agent_func": "tests.agent_fns:two_turn_digits"}, "one or the other"),
])
def test_bad_verifiers_envs_are_refused_naming_the_key(tmp_path, tiny_model, env, extra, message):
    with pytest.raises(ConfigError) as info:
        agent_config(tmp_path, tiny_model, agent={"agent_func": None, "task_file": None, "verifiers_env": env,
                                                  **extra})
    text = str(info.value)
    assert "agent.verifiers_env" in text and message in text, text


def test_verifiers_not_installed_is_refused_with_the_install_command(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1.utils.loaders", None)
    with pytest.raises(ConfigError) as info:
        verifiers_config(tmp_path, tiny_model)
    assert "agent.verifiers_env" in str(info.value) and "pip install 'verifiers==0.4.0'" in str(info.value)


def test_a_verifiers_config_loads_and_turns_the_endpoint_on(tmp_path, tiny_model):
    from roll_gspo.config.plan.endpoint import uses_verifiers

    cfg = verifiers_config(tmp_path, tiny_model)
    assert uses_verifiers(cfg) and cfg.rollout_endpoint.enabled


@pytest.mark.e2e
def test_a_multi_turn_verifiers_env_trains_through_the_endpoint(tmp_path, tiny_model, ray_session):
    """2 steps: each trained row is one verifiers trace (its id the row's episode id), its generated
    ids and log-probs what the engine sampled for the trace's two turns, its reward the rubric's."""
    import vf_two_turns

    from pipelines.agent_source import make_agent_source
    from pipelines.trainer_loop import TrainerLoop

    cfg = verifiers_config(tmp_path, tiny_model)
    vf_two_turns.SEEN.clear()
    loop = TrainerLoop(cfg, make_agent_source)
    batches = []
    produce = loop.source.produce

    def keep(step, timings):
        rollout = produce(step, timings)
        batches.append(rollout)
        return rollout

    loop.source.produce = keep
    try:
        loop.run()
    finally:
        loop.shutdown()
    assert len(batches) == 2
    for rollout in batches:
        batch = rollout.batch
        assert len(batch) == 4 and len(set(batch["episode_id"])) == 4
        for row, trace_id in enumerate(batch["episode_id"]):
            turns = vf_two_turns.SEEN[trace_id]
            assert len(turns) == 2  # the env's two turns, one trajectory: the second reused the first's ids
            start = int(batch["prompt_lengths"][row])
            mask = batch["loss_mask"][row].bool()
            generated = batch["input_ids"][row, start:start + mask.numel()][mask].tolist()
            assert generated == [t for ids, _ in turns for t in ids]
            logps = batch["rollout_log_probs"][row][mask]
            assert torch.allclose(logps, torch.tensor([lp for _, lps in turns for lp in lps]), atol=1e-6)
        rubric = [vf_two_turns.REWARDS[t] for t in batch["episode_id"]]
        assert rollout.metrics["verifiers/reward/digits"] == pytest.approx(sum(rubric) / 4)
        assert rollout.metrics["agent/reward_mean"] == pytest.approx(sum(rubric) / 4)
    logged = records(cfg.output_dir)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert r["agent/episodes"] == 4 and r["agent/errors"] == 0 and r["agent/timeouts"] == 0
        assert r["agent/history_mismatches"] == 0 and r["endpoint/engine_failures"] == 0
        assert "verifiers/reward/digits" in r and r["traj/num_turns_mean"] == 2
        assert "actor/pg_loss" in r


def test_the_verifiers_example_loads(tiny_model, monkeypatch):
    """examples/example_verifiers.yaml: its env (examples/verifiers_envs/vf_arith.py) resolves and
    loads its tasks; the endpoint is on."""
    from roll_gspo.config import load_config
    from roll_gspo.config.plan.endpoint import uses_verifiers
    from roll_gspo.serving.verifiers_env import load_env

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(ENVS), "..", "examples", "verifiers_envs"))
    cfg = load_config("example_verifiers.yaml", [f"pretrain={tiny_model}"])
    assert uses_verifiers(cfg) and cfg.rollout_endpoint.enabled
    env, tasks = load_env(cfg.agent.verifiers_env)
    assert type(env).__name__ == "SumEnv" and len(tasks) >= cfg.rollout_batch_size // cfg.train_env_manager.group_size
