"""A config written for GPUs, run on CPUs (roll_gspo.config.plan.cpu_run): ROLL's agentic recipes, unchanged
(tests/data/roll/agentic_unchanged/), pass --dry-run on a CPU with only models and outputs overridden; each GPU-only setting is adapted with one notice naming its keys, and
`roll_check` lists those keys as acting differently. Config-level: no Ray, no model weights."""
import logging
from pathlib import Path

import pytest

from roll_gspo.config import ConfigError, load_config, preflight
from tests.config_helpers import small_qwen2_config_folder

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
UNCHANGED = sorted((ROLL_DIR / "agentic_unchanged").glob("*.yaml"))
# The GPU-only settings ROLL's agentic recipes write, and the keys each is written at.
KNOBS = {
    "GPU placement": ["actor_train.device_mapping", "actor_infer.device_mapping", "reference.device_mapping"],
    "strategy_name": ["actor_train.strategy_args.strategy_name"],
    "attn_implementation": ["actor_train.model_args.attn_implementation", "reference.model_args.attn_implementation"],
    "vLLM block_size": ["actor_infer.strategy_args.strategy_config.block_size"],
    "vLLM gpu_memory_utilization": ["actor_infer.strategy_args.strategy_config.gpu_memory_utilization"],
}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A model folder holding only a config: a small Qwen2 that holds ROLL's 8192-token trajectories
    (the host-memory plan of --dry-run fits it on this machine; nothing is loaded)."""
    return small_qwen2_config_folder(tmp_path_factory.mktemp("small-qwen2"))


def knobs(recipe: Path) -> dict:
    """KNOBS, with the reference's Megatron strategy where the recipe writes one."""
    if "strategy_name: megatron_infer" not in recipe.read_text():
        return KNOBS
    return {**KNOBS, "strategy_name": KNOBS["strategy_name"] + ["reference.strategy_args.strategy_name"]}


def user_overrides(recipe: Path, model: str, out: Path, gpu_run: bool = False) -> list:
    """What a user changes in ROLL's recipe: models and outputs; for a GPU run (a described cluster)
    also the megatron_* strategy names, as Megatron-Core is not built here. Nothing else."""
    text = recipe.read_text()
    over = [f"pretrain={model}", f"reward_pretrain={model}", f"output_dir={out}", f"logging_dir={out}/logs",
            f"checkpoint_config.output_dir={out}/ckpt", f"tracker_kwargs.log_dir={out}/tb"]
    if not gpu_run:
        return over
    if "strategy_name: megatron_train" in text:
        over.append("actor_train.strategy_args.strategy_name=deepspeed_train")
    if "strategy_name: megatron_infer" in text:
        over.append("reference.strategy_args.strategy_name=deepspeed_infer")
    return over


@pytest.fixture
def in_roll_dir(monkeypatch):
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; `defaults:` paths are relative


def cpu_notices(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("notice: on CPU, ")]


@pytest.mark.parametrize("recipe", UNCHANGED, ids=[r.stem for r in UNCHANGED])
def test_roll_agentic_recipe_runs_on_cpu_with_one_notice_per_gpu_setting(recipe, small_model, tmp_path,
                                                                         in_roll_dir, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(recipe), user_overrides(recipe, small_model, tmp_path), cpu_host=True)
    preflight(cfg)
    notices = cpu_notices(caplog)
    assert len(notices) == len(KNOBS), notices  # one per setting, however many keys it covers
    for knob, keys in knobs(recipe).items():
        [notice] = [n for n in notices if n.startswith(f"notice: on CPU, {knob}")]
        assert notice.rpartition("; keys: ")[2].split(", ") == keys
    for name in ("actor_train", "actor_infer", "reference"):
        role = getattr(cfg, name)
        assert role.device_mapping is None and role.num_gpus_per_worker == 0 and role.world_size == 1
    assert cfg.actor_train.model_args.attn_implementation == cfg.reference.model_args.attn_implementation == "sdpa"
    assert cfg.actor_train.strategy_args.strategy_name == "deepspeed_train"
    engine = cfg.actor_infer.strategy_args.strategy_config
    assert engine["block_size"] == 32 and engine["gpu_memory_utilization"] in (0.6, 0.8)  # kept: vLLM ignores it on CPU
    assert any("attn_implementation: flash_attention_2 (ROLL's fa2) -> sdpa" in n for n in notices)
    assert any("vLLM block_size: 16 -> 32" in n for n in notices)


@pytest.mark.parametrize("recipe", UNCHANGED[:1] + UNCHANGED[2:3], ids=[UNCHANGED[0].stem, UNCHANGED[2].stem])
def test_roll_agentic_recipe_passes_dry_run_on_a_machine_without_gpu(recipe, small_model, tmp_path, in_roll_dir,
                                                                     monkeypatch, capsys):
    from roll_gspo.cli import main

    monkeypatch.setattr("roll_gspo.config.plan.cpu_run.cpu_only_host", lambda: True)
    assert main(["--config", str(recipe), "--dry-run", *user_overrides(recipe, small_model, tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "placement plan: no role uses a GPU" in out and "host memory plan (CPU run" in out
    assert "actor_infer 1 x 1 CPU" in out  # the agentic plan places the rollout engine too
    assert "dry run: config" in out and "agentic pipeline" in out


def test_a_described_gpu_cluster_keeps_the_gpu_settings(small_model, tmp_path, in_roll_dir, monkeypatch, caplog):
    from roll_gspo.cli import main

    monkeypatch.setattr("roll_gspo.config.plan.cpu_run.cpu_only_host", lambda: True)  # ignored: --nodes plans the GPU run
    recipe = UNCHANGED[0]
    with caplog.at_level(logging.WARNING):
        assert main(["--config", str(recipe), "--dry-run", "--nodes", "1", "--gpus-per-node", "8",
                     *user_overrides(recipe, small_model, tmp_path, gpu_run=True)]) == 0
    assert cpu_notices(caplog) == []
    cfg = load_config(str(recipe), user_overrides(recipe, small_model, tmp_path, gpu_run=True))  # as written
    assert cfg.actor_train.device_mapping == list(range(8)) and cfg.actor_train.world_size == 8
    assert cfg.actor_train.model_args.attn_implementation == "flash_attention_2"
    assert cfg.actor_infer.strategy_args.strategy_config["block_size"] == 16


def test_roles_without_gpu_placement_adapt_without_the_host_check(small_model, tmp_path, in_roll_dir, monkeypatch,
                                                                   caplog):
    """A config whose roles have no GPU (placement dropped on the command line, or a CPU config) is a
    CPU run wherever it loads: its GPU-only values are adapted, the placement notice does not appear."""
    monkeypatch.setattr("roll_gspo.config.plan.cpu_run.cpu_only_host", lambda: pytest.fail("no role has GPU placement: not asked"))
    recipe = UNCHANGED[0]
    over = user_overrides(recipe, small_model, tmp_path) + [
        f"~{name}.device_mapping" for name in ("actor_train", "actor_infer", "reference")]
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(recipe), over, cpu_host=None)
    assert sorted(n.partition("on CPU, ")[2].partition(":")[0] for n in cpu_notices(caplog)) == [
        "attn_implementation", "strategy_name", "vLLM block_size", "vLLM gpu_memory_utilization"]
    assert cfg.actor_train.model_args.attn_implementation == "sdpa"


def test_kv_cache_notice_names_the_roles_setting(small_model, tmp_path, in_roll_dir, caplog):
    recipe = UNCHANGED[0]
    over = user_overrides(recipe, small_model, tmp_path) + ["+actor_infer.system_envs.VLLM_CPU_KVCACHE_SPACE=4"]
    with caplog.at_level(logging.WARNING):
        load_config(str(recipe), over, cpu_host=True)
    assert any("VLLM_CPU_KVCACHE_SPACE = 4 GiB" in n for n in cpu_notices(caplog))


def test_roll_check_lists_the_adapted_keys_as_acting_differently(small_model, tmp_path, in_roll_dir):
    from roll_gspo.config.load.roll_check import roll_report

    recipe = UNCHANGED[0]
    report = roll_report(str(recipe), user_overrides(recipe, small_model, tmp_path), cpu_host=True)
    assert report.complete and not report.refused
    for knob, keys in KNOBS.items():
        for key in keys:
            assert report.differs[key].startswith(f"on CPU, {knob}"), (key, report.differs.get(key))
    assert "attn_implementation: flash_attention_2 (ROLL's fa2) -> sdpa" in report.text()


def test_cpu_only_host_joins_a_cluster_when_there_is_one(monkeypatch):
    import torch

    from roll_gspo.config.plan import cpu_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster to join: its GPUs decide, not this machine
    assert cpu_run.cpu_only_host() is False
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a private Ray on this machine
    assert cpu_run.cpu_only_host() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_run.cpu_only_host() is False


def test_gpu_placement_without_a_cpu_host_is_still_checked(small_model, tmp_path, in_roll_dir):
    """cpu_host False keeps a bad mapping's error (nothing is dropped to hide it)."""
    recipe = UNCHANGED[0]
    with pytest.raises(ConfigError, match="names no GPU"):
        load_config(str(recipe), user_overrides(recipe, small_model, tmp_path, gpu_run=True)
                    + ["actor_train.device_mapping=[]"])
