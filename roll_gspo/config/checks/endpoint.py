"""The rollout endpoint (`rollout_endpoint`) and agents as environments (`agent`): every rule of
their keys, in one place (docs/endpoint.md).

`rollout_endpoint.enabled` serves an OpenAI-compatible endpoint in front of the run's rollout ranks
for the whole run; `agent.agent_func` (agentic pipeline) plays a user's `async def agent(client,
task) -> float` through it as the step's episodes, and so turns the endpoint on.
"""
from __future__ import annotations

import os
from typing import AbstractSet, List, Optional

from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.checks.registry import check
from roll_gspo.config.plan.endpoint import serves_endpoint, uses_agent
from roll_gspo.schema.config import AgentConfig, PipelineConfig
from roll_gspo.envs.agents import agent_function, load_env, load_tasks
from roll_gspo.utils.net import is_loopback

KEY = "rollout_endpoint"
AGENT = "agent"


@check("derive", keys=(f"{KEY}.enabled",), doc="`agent.agent_func` or `agent.verifiers_env` set: the rollout endpoint on (its episodes go "
       "through it)", name="endpoint.agent_enables")
def _agent_enables_endpoint(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if not uses_agent(cfg) or cfg.rollout_endpoint.enabled:
        return []
    if yaml_keys is not None and f"{KEY}.enabled" in yaml_keys:
        return [error(f"{KEY}.enabled", f"{KEY}.enabled: false with an agent (agent.agent_func or agent.verifiers_env) "
                                        f"is refused: the agent's "
                                        f"episodes are played through the endpoint; remove the key")]
    cfg.rollout_endpoint.enabled = True
    return []


@check("check", keys=(KEY, "is_offload_states"),
       doc="`rollout_endpoint`: a port outside 0-65535, a non-loopback host without a token, an empty model name, "
           "a tool parser vLLM does not register, the sft pipeline, the rollout engine asleep between phases (beside "
           "request pools, async_rollout refuses it)", name="endpoint.problems")
def _endpoint_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    ep = cfg.rollout_endpoint
    if not ep.enabled:
        return []
    if not cfg.has_rollout():
        return [error(f"{KEY}.enabled", f"{KEY}.enabled: the {cfg.pipeline} pipeline has no rollout ranks to serve; "
                                        f"remove it")]
    problems = []
    if not isinstance(ep.port, int) or not 0 <= ep.port <= 65535:
        problems.append(error(f"{KEY}.port", f"{KEY}.port = {ep.port!r}: a TCP port, 0-65535 (0: a free one)"))
    if not ep.host or not isinstance(ep.host, str):
        problems.append(error(f"{KEY}.host", f"{KEY}.host: an address to listen on, got {ep.host!r}"))
    elif not is_loopback(ep.host) and not ep.token:
        problems.append(error(f"{KEY}.token", f"{KEY}.host = {ep.host!r} is not a loopback address: set {KEY}.token "
                                              f"(every request must then send it as `Authorization: Bearer <token>`, "
                                              f"the openai client's api_key), or listen on 127.0.0.1"))
    if ep.token is not None and (not isinstance(ep.token, str) or len(ep.token) < 8):
        problems.append(error(f"{KEY}.token", f"{KEY}.token: at least 8 characters (or null on loopback)"))
    if not ep.model_name or not isinstance(ep.model_name, str):
        problems.append(error(f"{KEY}.model_name", f"{KEY}.model_name: the name clients send, got {ep.model_name!r}"))
    if ep.tool_parser:
        try:
            from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

            known = ToolParserManager.list_registered()
        except Exception:  # noqa: BLE001  (vLLM not importable here: the server will say so at start)
            known = None
        if known is not None and ep.tool_parser not in known:
            problems.append(error(f"{KEY}.tool_parser", f"{KEY}.tool_parser = {ep.tool_parser!r} is not one of vLLM's "
                                                        f"tool parsers ({', '.join(sorted(known)[:12])}, ...); null "
                                                        f"leaves tool calls as text"))
    from roll_gspo.placement.colocation import offload_between_phases

    if offload_between_phases(cfg):
        problems.append(error(KEY, f"{KEY} with the rollout engine put to sleep between phases (is_offload_states, or "
                                   f"roles sharing GPUs) is refused: a request arriving while it sleeps would fail; "
                                   f"give the rollout ranks GPUs of their own or set is_offload_states: false"))
    return problems


@check("check", keys=(AGENT, "custom_envs", "eval_steps", "train_env_manager"),
       doc="`agent`: set outside the agentic pipeline, an agent_func that does not import or is not `async def "
           "f(client, task)`, a task_file that is missing or empty, timeout_s <= 0, max_concurrency < 0, with "
           "custom_envs, with eval_steps (validating an agent is not built), with step-wise env managers; "
           "`agent.verifiers_env`: verifiers not installed (the install command), no taskset.id, an unknown "
           "taskset / env / harness id or a field verifiers refuses, beside agent_func or task_file",
       name="endpoint.agent_problems")
def _agent_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    a = cfg.agent
    verifiers_key = f"{AGENT}.verifiers_env"
    if not a.agent_func and not a.verifiers_env:
        # Keys the YAML gives a value of its own (a printed config, `--print-config`, holds every default).
        defaults = AgentConfig()
        written = [k for k in (yaml_keys or ()) if k.startswith(f"{AGENT}.") and k != f"{AGENT}.agent_func"
                   and not k.startswith(verifiers_key)
                   and getattr(a, k.split(".")[1], None) != getattr(defaults, k.split(".")[1], None)]
        return [error(written[0], f"{written[0]}: read only with agent.agent_func or agent.verifiers_env; set one "
                                  f"or remove the key")] if written else []
    which = f"{AGENT}.agent_func" if a.agent_func else verifiers_key
    if cfg.pipeline != "agentic":
        return [error(which, f"{which}: agents train in the agentic pipeline; set pipeline: agentic (this is a "
                             f"{cfg.pipeline} config)")]
    if a.agent_func and a.verifiers_env:
        return [error(verifiers_key, f"{verifiers_key} with agent.agent_func: the agent is one or the other; remove "
                                     f"one")]
    problems = []
    if a.verifiers_env:
        problems += _verifiers_problems(a)
    else:
        problems += _agent_func_problems(a)
    if not (isinstance(a.timeout_s, (int, float)) and a.timeout_s > 0):
        problems.append(error(f"{AGENT}.timeout_s", f"{AGENT}.timeout_s: must be > 0, got {a.timeout_s!r}"))
    if not (isinstance(a.max_concurrency, int) and a.max_concurrency >= 0):
        problems.append(error(f"{AGENT}.max_concurrency", f"{AGENT}.max_concurrency: >= 0 (0: the whole step's "
                                                          f"episodes), got {a.max_concurrency!r}"))
    if cfg.custom_envs:
        problems.append(error("custom_envs", f"custom_envs with {which}: the agent is the environment of every "
                                             f"episode; remove custom_envs (or the agent)"))
    if cfg.eval_steps:
        problems.append(error("eval_steps", f"eval_steps with {which}: validating an agent is not built (its "
                                            f"requests are sampled at the training temperature); use 0"))
    return problems


def _agent_func_problems(a) -> List[Finding]:
    problems = []
    try:
        agent_function(a.agent_func)
    except (ValueError, ImportError) as exc:
        problems.append(error(f"{AGENT}.agent_func", f"{AGENT}.agent_func: {exc}"))
    if not a.task_file:
        problems.append(error(f"{AGENT}.task_file", f"{AGENT}.task_file: the agent's tasks (a .jsonl or .json file) "
                                                    f"are required"))
    elif not os.path.isfile(a.task_file):
        problems.append(error(f"{AGENT}.task_file", f"{AGENT}.task_file = {a.task_file!r}: no such file"))
    else:
        try:
            load_tasks(a.task_file, a.task_key)
        except ValueError as exc:
            problems.append(error(f"{AGENT}.task_file", f"{AGENT}.task_file: {exc}"))
    return problems


def _verifiers_problems(a) -> List[Finding]:
    key = f"{AGENT}.verifiers_env"
    if a.task_file or a.task_key:
        return [error(f"{AGENT}.task_file" if a.task_file else f"{AGENT}.task_key",
                      f"{AGENT}.task_file / task_key with {key}: the verifiers taskset gives the tasks; remove them")]
    if not hasattr(a.verifiers_env, "items"):
        return [error(key, f"{key}: verifiers' env block as a mapping ({{taskset: {{id: ...}}, ...}}), got "
                           f"{a.verifiers_env!r}")]
    try:
        load_env(a.verifiers_env)
    except (ImportError, ValueError) as exc:
        return [error(key, f"{key}: {exc}")]
    return []


@check("warn", keys=(KEY,), doc="`rollout_endpoint` on: where the address is printed, what is recorded",
       name="endpoint.notice")
def _endpoint_notice(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if not serves_endpoint(cfg) or uses_agent(cfg):
        return []
    return [notice(KEY, f"{KEY}: the run serves an OpenAI-compatible endpoint on {cfg.rollout_endpoint.host} and prints "
                        f"its address once the workers are up; requests are sampled at the rollout's generating_args "
                        f"beside the run's own generation and are neither trained on nor recorded (docs/endpoint.md)")]
