"""Pipelines runnable by `run_pipeline.py`: `rlvr` (GSPO/GRPO), `agentic` (multi-turn episodes) and `sft`.

Importing the package registers the builders of the built-in models that are warm starts (an SFT run
of a pipeline here; roll_gspo.builtin, a lower layer, names them without one)."""
from pipelines.warm_start import register_warm_starts
from roll_gspo.schema.config import PipelineConfig

register_warm_starts()


def run_pipeline_from_config(cfg: PipelineConfig):
    import os

    from roll_gspo.utils.logging import use_log_dir

    use_log_dir(os.path.join(cfg.output_dir, "logs"))  # third-party noise of every rank lands there
    if cfg.pipeline == "sft":
        from pipelines.sft_pipeline import run_sft

        return run_sft(cfg)
    if cfg.pipeline == "agentic":
        from roll_gspo.config.plan.endpoint import uses_agent

        if uses_agent(cfg):  # an agent's episodes, played through the run's endpoint
            from pipelines.agent_source import run_agent_pipeline

            return run_agent_pipeline(cfg)
        from pipelines.agentic_pipeline import run_agentic

        return run_agentic(cfg)
    from pipelines.rlvr_pipeline import run_rlvr

    return run_rlvr(cfg)
