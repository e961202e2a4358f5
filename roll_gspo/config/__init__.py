"""Typed, strict pipeline configuration, sorted by kind:

* `load/`: reading a YAML (Hydra composition, the strict typed walk), the generated key reference, the
  ROLL-YAML report (`python -m roll_gspo.config.load.roll_check`);
* `checks/`: the registered config steps, one module per concern, their runner (`validate_config`) and
  `preflight` (what a config names outside itself);
* `plan/`: what a run decides from its keys (`RunPlan`), the only thing run-time code reads besides the
  frozen config;
* `roll/`: ROLL's names and keys on this project's schema.

`errors`, `findings` and `typed_walk` are shared by these folders and stay at the root."""
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.load.loader import config_to_yaml, load_config, resolve_config_path
from roll_gspo.config.checks.preflight import preflight
from roll_gspo.config.checks.validate import validate_config
from roll_gspo.config.plan.run_plan import RunPlan, build_run_plan, freeze_config  # after validate: plan reads its modules

# The schema's dataclasses are roll_gspo.schema.config's, the read-only mode roll_gspo.schema.frozen's:
# one import path each.
__all__ = [
    "ConfigError", "config_to_yaml", "load_config", "preflight", "resolve_config_path", "validate_config", "RunPlan",
    "build_run_plan", "freeze_config",
]
