"""`teacher` role (on-policy distillation, `use_opd`): a frozen model scoring the student's sampled
tokens. It is the reference's worker on the `teacher` block, so it runs on any engine the reference
can use (hf_infer, a frozen DeepSpeed or FSDP2 engine), and fills `teacher_log_probs`."""
from __future__ import annotations

from roll_gspo.workers.reference import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    ROLE = "teacher"
    OUTPUT = "teacher_log_probs"
