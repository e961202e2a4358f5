"""`teacher` role (on-policy distillation, `use_opd`): a frozen model scoring the student's sampled
tokens. It is the reference's worker on a teacher block (`teacher`, or one of ROLL's named teachers),
so it runs on any engine the reference can use (hf_infer, a frozen DeepSpeed or FSDP2 engine), and
fills `teacher_log_probs`."""
from __future__ import annotations

from typing import Any, Dict

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.workers.reference import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    ROLE = "teacher"
    OUTPUT = "teacher_log_probs"

    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any], role_name: str = "teacher"):
        super().__init__(cfg, dist_env=dist_env)
        self.role_name = role_name  # `teacher` or `teacher.<name>` (cfg.teacher_roles())

    def role_block(self):
        return self.cfg.teacher_roles()[self.role_name]
