"""The code sandbox: a program run on this machine with no network, a read-only system, a private
size-capped /tmp and CPU, memory and process limits (`code_sandbox`), and the half of it that runs
inside (`sandbox_harness`, standard library only). The code reward (`roll_gspo.rewards.code_sandbox`)
and the agents' python tool (`roll_gspo.envs.tools.python_code`) both run their programs here.
"""
from roll_gspo.sandbox.code_sandbox import SANDBOX_KINDS, ProgramResult, Sandbox, parse_tests, run_program_tests

__all__ = ["SANDBOX_KINDS", "ProgramResult", "Sandbox", "parse_tests", "run_program_tests"]
