"""ROLL's own recipes (tests/data/roll/recipes/, each with only model paths, output folders and
megatron_* strategy names changed) load, pass preflight and --dry-run here, and the compatibility
report sorts their keys. The model paths point at a folder with a Qwen2.5-0.5B config (ROLL's
lengths, 2048 + 4096 tokens, need a model that holds them; nothing is loaded by these checks)."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roll_gspo.config import load_config, preflight

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
RECIPES = sorted((ROLL_DIR / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A model folder holding only a config (Qwen2.5-0.5B's shape, 32768 positions)."""
    folder = tmp_path_factory.mktemp("qwen2.5-0.5b-config")
    config = json.loads((REPO / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B.json").read_text())
    config.setdefault("max_position_embeddings", 32768)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def model_overrides(recipe: Path, folder: str) -> list:
    """The recipe's model paths pointed at `folder` (the one change a user makes besides outputs)."""
    text = recipe.read_text()
    over = [f"pretrain={folder}", f"reward_pretrain={folder}"]
    if "judge_model_type: inference" in text:
        over.append(f"rewards.llm_judge.model_args.model_name_or_path={folder}")
    return over


@pytest.fixture
def in_roll_dir(monkeypatch):
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; its data paths are relative


def run_recipe(args, monkeypatch) -> int:
    """`run_pipeline.py ARGS` from ROLL's repository root, as `roll_gspo.cli.main` in this process
    on the session's Ray (`ray_session`): the same code path from the command line down, without a
    fresh interpreter importing the stack and a private Ray starting and stopping (~12 s a run on
    2 cores). The drivers whose own process matters (kill -9, SIGTERM, the console) stay
    subprocesses elsewhere."""
    import ray

    from roll_gspo.cli import main

    assert ray.is_initialized(), "run_recipe needs the ray_session fixture"
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; its data paths are relative
    return main([str(arg) for arg in args])


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_roll_recipe_loads_and_passes_preflight(recipe, model_folder, in_roll_dir, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(recipe), model_overrides(recipe, model_folder))
    preflight(cfg)
    # ROLL ignores num_train_epochs in RLVR; here one notice says what acts instead.
    assert caplog.text.count("num_train_epochs = 50 is ignored in an rlvr run") <= 1
    # --dry-run's placement plan on the 2 x 8 GPUs ROLL's recipes are written for.
    from roll_gspo.cli import main

    assert main(["--config", str(recipe), "--dry-run", "--nodes", "2", "--gpus-per-node", "8",
                 *model_overrides(recipe, model_folder)]) == 0
    # Megatron's keys after the rename act in DeepSpeed's form.
    assert "tensor_model_parallel_size" not in cfg.actor_train.strategy_args.strategy_config
    for domain, reward in cfg.rewards.items():
        if reward.device_mapping is not None:  # ROLL's judge GPUs: parsed, placed, its own ranks
            assert reward.world_size == len(reward.device_mapping) // int(reward.num_gpus_per_worker)


def test_megatron_keys_translate_to_deepspeed(model_folder, in_roll_dir):
    recipe = ROLL_DIR / "recipes" / "rlvr_config.yaml"
    cfg = load_config(str(recipe), model_overrides(recipe, model_folder))
    train = cfg.actor_train
    assert train.strategy_args.strategy_config["zero_optimization"]["stage"] == 1  # use_distributed_optimizer
    assert train.model_args.gradient_checkpointing  # recompute_granularity: full


def test_judge_sharing_the_trainers_gpus_sleeps_and_the_rollouts_is_refused(model_folder, in_roll_dir):
    from roll_gspo.config import ConfigError

    recipe = ROLL_DIR / "recipes" / "rlvr_config.yaml"
    cfg = load_config(str(recipe), model_overrides(recipe, model_folder))
    judge = cfg.rewards["llm_judge"]
    assert judge.device_mapping == [12, 13, 14, 15] and judge.strategy_args.strategy_config["sleep_level"] == 1
    with pytest.raises(ConfigError, match=r"rewards.llm_judge.device_mapping shares GPUs \[8, 9, 10, 11\] with "
                                          r"actor_infer.device_mapping"):
        load_config(str(recipe), model_overrides(recipe, model_folder) + ["rewards.llm_judge.device_mapping=[8,9,10,11]"])
    with pytest.raises(ConfigError, match="async_generation_ratio = 1 rewards are scored while the trainer trains"):
        load_config(str(recipe), model_overrides(recipe, model_folder) + ["async_generation_ratio=1"])
    gspo = ROLL_DIR / "recipes" / "example_gspo.yaml"  # an hf_infer judge with fa2, placed on CPUs: sdpa there
    cpu_judge = load_config(str(gspo), model_overrides(gspo, model_folder) + ["rewards.llm_judge.device_mapping=null"])
    assert cpu_judge.rewards["llm_judge"].model_args.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="MathRuleRewardWorker scores by rules on CPUs"):
        load_config(str(recipe), model_overrides(recipe, model_folder) + ["+rewards.math_rule.device_mapping=[12]"])


def test_dry_run_plans_the_judge_on_its_gpus(model_folder, tmp_path):
    recipe = ROLL_DIR / "recipes" / "rlvr_config.yaml"
    result = subprocess.run(
        [sys.executable, str(REPO / "run_pipeline.py"), "--config", str(recipe.relative_to(ROLL_DIR)), "--dry-run",
         "--nodes", "2", "--gpus-per-node", "8", "--device-memory-gb", "80", *model_overrides(recipe, model_folder)],
        cwd=ROLL_DIR, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "dry run: config" in result.stdout
    # The judge's ranks on its mapped GPUs (12-15: node 1, GPUs 4-7), with their memory.
    assert "rewards.llm_judge rank 3 (LLM judge, vLLM): claims 64.00 GiB (gpu_memory_utilization 0.8)" in result.stdout


def test_roll_check_report_sorts_every_key(model_folder, in_roll_dir):
    from roll_gspo.config.load.roll_check import roll_report

    recipe = ROLL_DIR / "recipes" / "rlvr_config.yaml"
    report = roll_report(str(recipe), model_overrides(recipe, model_folder))
    assert report.complete and not report.refused, report.text()
    assert "actor_train.training_args.num_train_epochs" in report.ignored
    assert "MultipleChoiceRewardWorker" in report.differs["rewards.crossthinkqa.worker_cls"]
    assert "exp_name" in report.acts
    # A refused key is named with its reason; the report says later stages did not run.
    bad = roll_report(str(recipe), model_overrides(recipe, model_folder) + ["actor_infer.generating_args.num_beams=4"])
    assert "beam search is not built" in bad.refused["actor_infer.generating_args.num_beams"]
    assert not bad.complete and "a later stage may refuse more" in bad.text()


def recipe_cpu_overrides(recipe: Path, out: Path) -> list:
    """What a CPU machine (and the built-in 256-token model) needs of a 16-GPU recipe, on the
    command line: the GPU placement dropped, vLLM's CPU block size, lengths and batch sizes that
    fit, one worker per reward domain, a judge prompt short enough for a character-level judge."""
    text = recipe.read_text()
    over = [f"{key}.device_mapping=null" for key in ("actor_train", "actor_infer", "reference", "rewards.llm_judge")]
    over += ["actor_infer.strategy_args.strategy_config.block_size=32",
             "actor_infer.strategy_args.strategy_config.max_model_len=256",
             "prompt_length=192", "response_length=32", "rollout_batch_size=5", "num_return_sequences_in_group=4",
             # one prompt of each domain per batch, so two steps score all five
             "actor_train.data_args.domain_interleave_probs={math_rule: 0.2, code_sandbox: 0.2, llm_judge: 0.2, "
             "crossthinkqa: 0.2, ifeval: 0.2}",
             "actor_train.training_args.gradient_accumulation_steps=4", "max_steps=2", "eval_steps=0",
             "actor_train.num_cpus_per_worker=0.5", "actor_infer.num_cpus_per_worker=0.5",
             "rewards.llm_judge.judge_prompt='Q{question} R{response} T{reference} '",
             "rewards.llm_judge.generating_args.max_new_tokens=8",
             f"output_dir={out}", f"logging_dir={out}/logs", f"checkpoint_config.output_dir={out}/ckpt",
             f"tracker_kwargs.log_dir={out}/tb"]
    over += [f"rewards.{domain}.world_size=1" for domain in ("crossthinkqa", "ifeval", "math_rule", "code_sandbox")]
    if "strategy_name: hf_infer" in text.split("llm_judge:")[-1]:  # FlashAttention is GPU-only
        over.append("rewards.llm_judge.model_args.attn_implementation=sdpa")
    if "strategy_name: vllm\n      strategy_config:\n        gpu_memory_utilization" in text:  # a vLLM judge
        over += ["rewards.llm_judge.strategy_args.strategy_config.block_size=32",
                 "rewards.llm_judge.strategy_args.strategy_config.max_model_len=256"]
    return over


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["rlvr_config", "example_gspo"])
def test_five_domain_roll_recipe_trains_two_steps_on_cpu(name, tmp_path, session_cache, ray_session, monkeypatch):
    """ROLL's five-domain recipe (math, code sandbox, LLM judge in the worker, ifeval,
    CrossThinkQA; a vLLM judge) and its GSPO example (an hf_infer judge) train 2 steps on CPU
    with the built-in model; every domain is scored."""
    recipe = ROLL_DIR / "recipes" / f"{name}.yaml"
    assert run_recipe(["--config", recipe.relative_to(ROLL_DIR), *recipe_cpu_overrides(recipe, tmp_path)],
                      monkeypatch) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    scored = {key.split("/")[1] for m in steps for key in m if key.startswith("reward/") and key.count("/") == 2}
    # Metrics go by the rows' tags (ROLL's `tag_included`): code, judge, ifeval, CrossThinkQA, math.
    assert {"KodCode", "RLVR", "ifeval", "crossthinkqa"} <= scored and scored & {"aime", "deepmath_103k"}, sorted(scored)
    assert any("reward/ifeval/prompt_level_strict_acc" in m for m in steps)
