"""An agent written only against the `openai` client trains through the run's rollout endpoint
(`agent.agent_func`) in a run (an RLVR run serving the endpoint is the resumed run of
tests/test_resume_reshape.py's pipeline test). Bad values of both blocks
(`rollout_endpoint`, `agent`) are refused at load, naming the key."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from roll_gspo.config import ConfigError, load_config

from tests.test_agentic_e2e import records
from tests.test_pipeline_e2e import write_config

TASKS = [{"question": f"{a}+{a + 1}=", "n": a} for a in range(8)]


def agent_config(tmp_path, model, **changes):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    base = {
        "pipeline": "agentic", "exp_name": "agent_test", "seed": 5, "track_with": "none", "max_steps": 2,
        "output_dir": str(tmp_path / "out"), "pretrain": model, "sequence_length": 256, "rollout_batch_size": 4,
        "eval_steps": 0, "adv_estimator": "grpo", "importance_sampling": "seq", "pg_clip_low": 0.2,
        "pg_clip_high": 0.2,
        "agent": {"agent_func": "tests.agent_fns:two_turn_digits", "task_file": str(tasks), "timeout_s": 60},
        "train_env_manager": {"group_size": 2, "num_env_groups": 2, "generating_args": {"max_new_tokens": 6}},
        "reward_normalization": {"grouping": "traj_group_id", "method": "mean_std"},
        "actor_train": {"model_args": {"dtype": "fp32"}, "data_args": {"template": "chatml"},
                        "training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 4},
                        "strategy_args": {"strategy_name": "deepspeed_train",
                                          "strategy_config": {"zero_optimization": {"stage": 0}}},
                        "num_cpus_per_worker": 0.5},
        "actor_infer": {"generating_args": {"temperature": 1.0},
                        "strategy_args": {"strategy_name": "vllm",
                                          "strategy_config": {"enforce_eager": True, "dtype": "float32"}},
                        "num_cpus_per_worker": 0.5},
    }
    cfg = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(changes))
    path = tmp_path / "agent.yaml"
    OmegaConf.save(cfg, path)
    return load_config(str(path))


@pytest.mark.parametrize("change,key,message", [
    ({"rollout_endpoint": {"enabled": True, "port": 70000}}, "rollout_endpoint.port", "0-65535"),
    ({"rollout_endpoint": {"enabled": True, "host": "0.0.0.0"}}, "rollout_endpoint.token", "not a loopback"),
    ({"rollout_endpoint": {"enabled": True, "tool_parser": "nope"}}, "rollout_endpoint.tool_parser", "tool parsers"),
    ({"rollout_endpoint": {"enabled": True}, "async_generation_ratio": 2,
      "actor_infer": {"generating_args": {"temperature": 1.0}}}, "async_generation_ratio", "request pools"),
    ({"agent": {"agent_func": "tests.agent_fns:two_turn_digits", "task_file": "x.jsonl"}}, "agent.agent_func",
     "agentic pipeline"),
    ({"agent": {"timeout_s": 5}}, "agent.timeout_s", "only with agent.agent_func"),
])
def test_bad_endpoint_and_agent_keys_in_an_rlvr_config_are_refused(tmp_path, tiny_model, change, key, message):
    with pytest.raises(ConfigError) as caught:
        write_config(tmp_path, tiny_model, **change)
    assert any(f.key == key and message in f.message for f in caught.value.findings), caught.value


@pytest.mark.parametrize("change,key,message", [
    ({"agent": {"agent_func": "tests.agent_fns:not_async"}}, "agent.agent_func", "not an async function"),
    ({"agent": {"agent_func": "tests.agent_fns:missing"}}, "agent.agent_func", "no attribute"),
    ({"agent": {"task_file": "/nonexistent.jsonl"}}, "agent.task_file", "no such file"),
    ({"agent": {"task_key": "prompt"}}, "agent.task_file", "task_key"),
    ({"agent": {"timeout_s": 0}}, "agent.timeout_s", "> 0"),
    ({"eval_steps": 1}, "eval_steps", "not built"),
    ({"rollout_endpoint": {"enabled": False}}, "rollout_endpoint.enabled", "through the endpoint"),
])
def test_bad_agent_keys_are_refused(tmp_path, tiny_model, change, key, message):
    with pytest.raises(ConfigError) as caught:
        agent_config(tmp_path, tiny_model, **change)
    assert any(f.key == key and message in f.message for f in caught.value.findings), caught.value


def test_an_agent_config_loads_and_turns_the_endpoint_on(tmp_path, tiny_model):
    cfg = agent_config(tmp_path, tiny_model)
    assert cfg.rollout_endpoint.enabled and cfg.rollout_endpoint.host == "127.0.0.1"


# An RLVR run serving the endpoint (the address printed, a client served before and after a step, the
# endpoint stopped with the run) is the resumed run of
# tests/test_resume_reshape.py::test_pipeline_two_ranks_resume_on_one_and_train_on: one run, both checks.


@pytest.mark.e2e
def test_an_openai_client_agent_trains_through_the_endpoint(tmp_path, tiny_model, ray_session):
    """2 steps of an agent's episodes: each trained row's generated ids and their log-probs are what
    the endpoint returned to the agent (the engine's), the agent's return its reward, metrics logged."""
    from pipelines.agent_source import make_agent_source
    from pipelines.trainer_loop import TrainerLoop
    from tests import agent_fns

    # hf_infer ranks (no vLLM start): the path under test is the agent's ids through the endpoint to
    # the trained rows, the same for either engine (vLLM behind the endpoint in a run: test_resume_reshape).
    cfg = agent_config(tmp_path, tiny_model, actor_infer={"strategy_args": {"strategy_name": "hf_infer"}})
    agent_fns.SEEN.clear()
    loop = TrainerLoop(cfg, make_agent_source)
    batches = []
    produce = loop.source.produce

    def keep(step, timings):  # the rollouts the loop trains on, kept for the comparison below
        rollout = produce(step, timings)
        batches.append(rollout.batch)
        return rollout

    loop.source.produce = keep
    try:
        loop.run()
    finally:
        loop.shutdown()
    assert len(batches) == 2
    for batch in batches:
        assert len(batch) == 4 and len(set(batch["episode_id"])) == 4
        for row, episode in enumerate(batch["episode_id"]):
            turns = agent_fns.SEEN[episode]
            assert len(turns) == 2  # two requests, one trajectory: the second reused the first's ids
            start = int(batch["prompt_lengths"][row])
            mask = batch["loss_mask"][row].bool()
            generated = batch["input_ids"][row, start:start + mask.numel()][mask].tolist()
            assert generated == [t for ids, _ in turns for t in ids]
            logps = batch["rollout_log_probs"][row][mask]
            assert torch.allclose(logps, torch.tensor([lp for _, lps in turns for lp in lps]), atol=1e-6)
    logged = records(cfg.output_dir)
    assert [r["step"] for r in logged] == [1, 2]
    from roll_gspo.metrics.rollouts import read_step, step_files  # the rollout files: the agent's episodes as trained

    recorded = read_step(step_files(cfg.rollout_dump_dir)[-1][1])
    assert len(recorded) == 4 and all(r["turns"] and r["turns"][0]["action"] for r in recorded)
    for r in logged:
        assert r["agent/episodes"] == 4 and r["agent/errors"] == 0 and r["agent/timeouts"] == 0
        assert r["agent/history_mismatches"] == 0 and r["endpoint/engine_failures"] == 0
        assert 0 <= r["traj/reward_mean"] <= 1 and r["traj/num_turns_mean"] == 2
        assert "actor/pg_loss" in r
    assert os.path.isdir(os.path.join(cfg.output_dir, "final_model"))
