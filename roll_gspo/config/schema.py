"""The schema's old home: it lives in `roll_gspo.schema.config` (the ground floor, importable by
placement and distributed); every public name is re-exported here for existing imports."""
from roll_gspo.schema.config import *  # noqa: F401,F403
from roll_gspo.schema.config import DEFAULT_JUDGE_MAX_NEW_TOKENS, PipelineConfig, RewardConfig, RoleConfig  # noqa: F401
