"""The schema on the ground floor: the dataclasses of every key a pipeline reads (`config`) and
what makes a loaded config read-only (`frozen`). It imports nothing of the project but the catalog
(the facts of estimators and reward workers), so every layer above may name `PipelineConfig`.

Loading, checking and the run plan are `roll_gspo.config`'s."""
from roll_gspo.schema.config import PipelineConfig, RewardConfig, RoleConfig
from roll_gspo.schema.frozen import ReadOnlyConfigError, freeze, is_frozen, replaced, thawed

__all__ = ["PipelineConfig", "RewardConfig", "RoleConfig", "ReadOnlyConfigError", "freeze", "is_frozen", "replaced",
           "thawed"]
