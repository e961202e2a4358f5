"""Warm starts of the built-in agentic examples: `builtin:tiny-frozenlake` and `builtin:tiny-calculator`.

The built-in tiny model after a short SFT run on turns played in the real environment, through the
real episode loop: `EpisodeRunner` plays episodes of the example's `custom_envs` entry with a
scripted policy in place of the rollout engine, and every turn becomes one SFT row, prompt = the
conversation's ids before the turn, response = the turn's action (the SFT pipeline appends the end
of sequence the engine's turn ended with). So SFT sees exactly the ids RL will see: the same
rendering, templates and observations, no separate formatter to drift.

The scripted policies are mediocre on purpose (a mix of the right move and random ones, a tool
called only some of the time), so RL starts from a model that knows the format and is sometimes
right, with something left to learn from rewards. Built on first use, then cached, like
`builtin:tiny-arith` (`pipelines/warm_start.py` registers both builders).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner, TurnOutput, TurnRequest
from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory, turn_samples
from roll_gspo.schema.config import CustomEnvConfig, PipelineConfig, ToolWrapperConfig

logger = logging.getLogger("roll_gspo")

# (env, turn index, rng) -> the turn's text. `env` is the episode's env object as the runner built it.
Policy = Callable[[Any, int, random.Random], str]


@dataclasses.dataclass
class AgenticWarmStart:
    """One warm-started model: the env it is trained on (a custom_envs entry, YAML form) and the
    scripted policy whose turns SFT imitates."""
    name: str
    sft_config: str  # configs/ file; its data_args.file_name is the rows played here
    tag: str
    env: Dict[str, Any]  # custom_envs.<tag> of the example, verbatim (tests/test_agentic_examples.py checks)
    policy: Policy
    episodes: int
    sequence_length: int
    seed: int = 0
    # env_config entries replaced while playing the SFT episodes only (what the agent sees is unchanged)
    play_overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def env_config(self) -> CustomEnvConfig:
        """The custom_envs entry as the config loader builds it."""
        fields = dict(self.env)
        wrapper = fields.pop("tool_wrapper", None)
        return CustomEnvConfig(**fields, tool_wrapper=ToolWrapperConfig(**wrapper) if wrapper else None)


# -- FrozenLake ------------------------------------------------------------------------------------
# The scripted agent knows the way but has a habit: where the shortest path goes Right or Up, it
# turns a quarter clockwise instead (Right -> Down, Up -> Right) with probability
# FROZEN_LAKE_HABIT; its other moves are the shortest path's. Both its moves are functions of the
# board, so SFT learns them fast (random moves would be noise to learn through), and a model that
# imitates it solves a map greedily only when no Right or Up is needed (about a third of 3x3
# maps), while its samples often take the right turn: what RL can learn from rewards.
FROZEN_LAKE_HABIT = 0.7
HABIT_TURNS = {"Right": "Down", "Up": "Right"}
FROZEN_LAKE_ENV: Dict[str, Any] = {
    "env_type": "frozen_lake",
    "max_steps": 5,  # turns; a 3x3 map's shortest path is at most 4 moves
    "max_tokens_per_step": 3,  # one letter and <eos>; a third token is room to ramble (an invalid action)
    "agent_system_template": "",
    "agent_template": "{observation}\n",
    "env_config": {"size": 3, "p": 0.8, "is_slippery": False, "action_pattern": "^(.*)$", "env_instruction": ""},
}


def frozen_lake_policy(env: Any, turn: int, rng: random.Random) -> str:
    """A move's initial (L/D/R/U): the shortest path's first move, or the habit's turn of it."""
    move = env.shortest_path()[0]
    if move in HABIT_TURNS and rng.random() < FROZEN_LAKE_HABIT:
        move = HABIT_TURNS[move]
    return move[0]


# -- math with a calculator ------------------------------------------------------------------------
# Calls the calculator on the question's expression with probability CALCULATOR_USE, then copies
# its result into \boxed{}; otherwise answers at once (the right answer: the tiny model cannot
# multiply, so its own answers are mostly wrong and a call pays).
CALCULATOR_USE = 0.5
CALCULATOR_ENV: Dict[str, Any] = {
    "env_type": "math_python",
    "max_steps": 3,  # a call, the answer, one turn of slack
    "max_tokens_per_step": 96,  # a call is about 80 characters
    "agent_system_template": "",
    "agent_template": "{observation}\n",
    "env_config": {"num_operands": 2, "max_operand": 20, "operators": "+-*", "env_instruction": ""},
    "tool_wrapper": {"wrapper_args": {"max_tool_uses": 2, "tool_instruction_target": "none"},
                     "tool_configs": [{"tool_id": "calculator", "tool_args": {"timeout": 5}}]},
}


def calculator_call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def calculator_policy(env: Any, turn: int, rng: random.Random) -> str:
    """Turn 0: a calculator call on the question's expression (probability CALCULATOR_USE), else the
    answer; after a call: its result, boxed."""
    math_env = env.unwrapped
    if turn == 0 and rng.random() < CALCULATOR_USE:
        expression = math_env.question[len("What is "):].rstrip("?")
        return calculator_call(expression)
    return "\\boxed{%s}" % math_env.answer


WARM_STARTS: Dict[str, AgenticWarmStart] = {
    "builtin:tiny-frozenlake": AgenticWarmStart(
        "builtin:tiny-frozenlake", "sft_tiny_frozenlake.yaml", "FrozenLake", FROZEN_LAKE_ENV, frozen_lake_policy,
        episodes=2000, sequence_length=96),
    "builtin:tiny-calculator": AgenticWarmStart(
        "builtin:tiny-calculator", "sft_tiny_calculator.yaml", "MathCalculator", CALCULATOR_ENV, calculator_policy,
        episodes=3000, sequence_length=192,
        # Same results, no fork per call: the data's thousands of calls would take a minute.
        play_overrides={"tool_wrapper.tool_configs": [{"tool_id": "calculator",
                                                        "tool_args": {"timeout": 5, "isolation": "thread"}}]}),
}


# -- playing the episodes ----------------------------------------------------------------------------
class _RecordingRunner(EpisodeRunner):
    """The pipeline's episode loop, keeping each episode's env object for the scripted policy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live: Dict[int, Any] = {}

    def _reset(self, t: Trajectory, envs: Dict[int, Any]):
        result = super()._reset(t, envs)
        self.live[t.spec.index] = envs[t.spec.index]
        return result


def env_setups(start: AgenticWarmStart, for_play: bool = False) -> Dict[str, EnvSetup]:
    """The pipeline's env setup of the warm start's custom_envs entry (pipelines.agentic_pipeline)."""
    from pipelines.agentic_pipeline import build_env_setups

    env_cfg = start.env_config()
    if for_play and "tool_wrapper.tool_configs" in start.play_overrides:
        env_cfg.tool_wrapper.tool_configs = start.play_overrides["tool_wrapper.tool_configs"]
    cfg = PipelineConfig()
    cfg.custom_envs = {start.tag: env_cfg}
    cfg.train_env_manager.tags = [start.tag]
    cfg.eval_steps = 0
    return build_env_setups(cfg)


def play(start: AgenticWarmStart, tokenizer, generate_for: Callable[[_RecordingRunner], Callable], episodes: int,
         seed: int, for_play: bool = False) -> List[Trajectory]:
    """`episodes` episodes of the warm start's env, each from its own seed, turns from `generate_for(runner)`."""
    setups = env_setups(start, for_play)
    env_cfg = setups[start.tag].config
    runner = _RecordingRunner(ChatStitcher(tokenizer, None), setups, sequence_length=start.sequence_length,
                              max_new_tokens=env_cfg.max_tokens_per_step)
    rng = random.Random(seed)
    specs = [EpisodeSpec(start.tag, rng.randrange(2 ** 31 - 1), f"warm_start_{i}", i) for i in range(episodes)]
    return runner.run(specs, generate_for(runner), lambda index, turn: (seed + 7919 * index + turn) % (2 ** 31 - 1))


def scripted_generate(start: AgenticWarmStart, tokenizer, seed: int):
    """A rollout engine that answers each turn with the warm start's policy (log-probs 0)."""
    eos = tokenizer.eos_token_id

    def generate_for(runner: _RecordingRunner):
        def generate(requests: List[TurnRequest]) -> List[TurnOutput]:
            outputs = []
            for request in requests:
                env = runner.live[request.index]
                turn = request.prompt_ids.count(eos)  # every earlier (scripted) turn ended with <eos>
                text = start.policy(env, turn, random.Random(request.seed))
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]
                if len(ids) > request.max_new_tokens:
                    raise ValueError(f"{start.name}: the scripted turn {text!r} takes {len(ids)} tokens, more than "
                                     f"the turn's cap {request.max_new_tokens} (max_tokens_per_step / sequence_length)")
                outputs.append(TurnOutput(ids, [0.0] * len(ids)))
            return outputs
        return generate
    return generate_for


def sft_rows(start: AgenticWarmStart, tokenizer, episodes: Optional[int] = None, seed: Optional[int] = None
             ) -> List[Dict[str, str]]:
    """One `{prompt, response}` row per turn of the scripted episodes. The prompt is the text of the
    conversation's ids before the turn, the response the turn's text without its <eos>; both
    tokenise back to exactly those ids (checked: a row that does not is an error, not a skip)."""
    seed = start.seed if seed is None else seed
    trajectories = play(start, tokenizer, scripted_generate(start, tokenizer, seed), episodes or start.episodes, seed,
                        for_play=True)
    failed = [t for t in trajectories if t.stop_reason in ("env_error", "env_timeout", "max_length")]
    if failed:
        raise RuntimeError(f"{start.name}: {len(failed)} scripted episodes ended by {failed[0].stop_reason} "
                           f"({failed[0].error}); the warm start's env or sequence_length is wrong")
    eos = tokenizer.eos_token_id
    rows = []
    for sample in turn_samples(trajectories):
        t = sample.trajectory
        context = t.prompt_ids + t.response_ids[:sample.start]
        action = t.response_ids[sample.start:sample.end]
        if action[-1] != eos:
            raise AssertionError(f"{start.name}: a scripted turn does not end with <eos>: {action}")
        row = {"prompt": tokenizer.decode(context, skip_special_tokens=False),
               "response": tokenizer.decode(action[:-1], skip_special_tokens=False)}
        if (list(tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]) != context
                or list(tokenizer(row["response"], add_special_tokens=False)["input_ids"]) != action[:-1]):
            raise AssertionError(f"{start.name}: row does not tokenise back to its ids: {row}")
        rows.append(row)
    return rows


def evaluate(model_dir: str, start: AgenticWarmStart, episodes: int = 128, temperature: float = 0.0,
             seed: int = 1) -> Dict[str, float]:
    """A model on `episodes` fresh episodes, its turns generated with transformers: the fraction
    solved, and tool calls per episode."""
    from transformers import AutoTokenizer

    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    role = RoleConfig(infer_batch_size=256)
    role.model_args.model_name_or_path = model_dir
    strategy = HfInferStrategy(role, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gen = GeneratingArgs(max_new_tokens=start.env_config().max_tokens_per_step, temperature=temperature)

    def generate_for(runner):
        def generate(requests: List[TurnRequest]) -> List[TurnOutput]:
            samples = strategy.generate([r.prompt_ids for r in requests], gen, 1, seeds=[r.seed for r in requests])
            return [TurnOutput(list(s[0][0])[:r.max_new_tokens], list(s[0][1])[:r.max_new_tokens])
                    for s, r in zip(samples, requests)]
        return generate

    trajectories = play(start, tokenizer, generate_for, episodes, seed + 1_000_003)
    return {"success_rate": sum(t.success for t in trajectories) / len(trajectories),
            "tool_calls_per_episode": sum(t.tool_calls for t in trajectories) / len(trajectories)}


# -- the builders ------------------------------------------------------------------------------------
def build_agentic_warm_start(folder: str, name: str, overrides: Sequence[str] = ()) -> None:
    """Play the SFT rows, run the SFT pipeline on them (its config names the base model and the
    training; `overrides` in Hydra's grammar change it), copy the final model into `folder`."""
    from transformers import AutoTokenizer

    from roll_gspo.builtin.models import resolve_model
    from roll_gspo.config import load_config

    from pipelines.sft_pipeline import run_sft

    start = WARM_STARTS[name]
    with tempfile.TemporaryDirectory(prefix="roll_gspo_sft_") as work:
        data = os.path.join(work, "rows.jsonl")
        cfg = load_config(start.sft_config, [f"output_dir={work}/sft", f"actor_train.data_args.file_name=[{data}]",
                                              *overrides])
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.actor_train.model_args.model_name_or_path))
        rows = sft_rows(start, tokenizer)
        with open(data, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
        logger.info("warm-starting %s with SFT (%s) on %d turns of %d scripted episodes; runs once, then cached",
                    name, start.sft_config, len(rows), start.episodes)
        run_sft(cfg)
        for entry in os.listdir(os.path.join(work, "sft", "final_model")):
            shutil.copy2(os.path.join(work, "sft", "final_model", entry), folder)
    greedy, sampled = evaluate(folder, start), evaluate(folder, start, temperature=1.0)
    logger.info("%s warm start on fresh %s episodes: greedy %.2f solved (%.2f tool calls each), sampling at "
                "temperature 1 %.2f solved (%.2f tool calls each)", name, start.tag, greedy["success_rate"],
                greedy["tool_calls_per_episode"], sampled["success_rate"], sampled["tool_calls_per_episode"])

