"""Agentic environments and tools (roll_gspo/envs): the built-in games, the registry's checks, the
tool wrapper, the Python tool in the code sandbox and function tools. Fast unit tests: no Ray, no
vLLM, no model."""
import importlib.util
import json
import os
import threading
import time
import uuid
from typing import List, Optional

import pytest

from roll_gspo.envs import (ENV_TYPES, Env, FunctionTool, PythonCodeTool, Tool, ToolCall, ToolEnvWrapper,
                            build_tools, calculator, env_problems, make_env, tool_problems, wrap_with_tools,
                            wrapper_problems)
from roll_gspo.envs.frozen_lake import FrozenLakeEnv, generate_random_map
from roll_gspo.envs.math_python import answers_match, last_boxed
from roll_gspo.envs.sokoban import Room, SokobanEnv
from roll_gspo.utils.imports import import_object


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


# -- a user's env and functions, reached by class path ------------------------------------------
class CountdownEnv:
    """A user's env by duck type (no base class): say numbers down to zero."""

    def __init__(self, start: int = 3):
        self.start = start

    def reset(self, seed=None):
        self.left = self.start
        return str(self.left), {}

    def step(self, action):
        ok = action.strip() == str(self.left - 1)
        self.left -= ok
        return str(self.left), float(ok), self.left == 0, False, {"action_is_valid": ok}


class NotAnEnv:
    def __init__(self, x: int = 0):
        pass


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"exploded: {reason}")


def spin(seconds: float) -> str:
    """Never returns."""
    while True:
        pass


RELEASE = threading.Event()


def block(seconds: float) -> str:
    """Waits until the test releases it (a thread cannot be killed: it must not spin forever)."""
    RELEASE.wait(60)
    return "released"


def no_hints(a, b: int):
    return a


def scale(values: List[float], factor: Optional[float] = None) -> dict:
    """Multiply values."""
    return {"values": [v * (factor or 1.0) for v in values]}


# -- FrozenLake -----------------------------------------------------------------------------------
def test_frozen_lake_is_deterministic_per_seed_and_maps_vary():
    a, b = FrozenLakeEnv(is_slippery=False), FrozenLakeEnv(is_slippery=False)
    assert a.reset(7) == b.reset(7)
    assert len({FrozenLakeEnv().reset(seed)[0] for seed in range(12)}) > 6


@pytest.mark.parametrize("size,p", [(3, 0.8), (4, 0.5), (6, 0.3), (8, 0.05)])
def test_frozen_lake_generated_maps_are_always_solvable(size, p):
    import random

    for seed in range(40):
        rows = generate_random_map(size, p, random.Random(seed))
        assert len(rows) == size and all(len(r) == size for r in rows)
        assert "".join(rows).count("S") == 1 and "".join(rows).count("G") == 1
        env = FrozenLakeEnv(desc=rows, is_slippery=False)
        env.reset(0)
        assert env.shortest_path() is not None, rows


def test_frozen_lake_scripted_shortest_path_reaches_the_goal():
    for seed in range(10):
        env = make_env("frozen_lake", {"is_slippery": False, "size": 5, "max_steps": 30})
        observation, info = env.reset(seed)
        assert "<answer>Right</answer>" in info["env_instruction"]
        total = 0.0
        for i, move in enumerate(env.shortest_path()):
            observation, reward, terminated, truncated, info = env.step(answer(move if i % 2 else move[0].lower()))
            total += reward
            assert info["action_is_valid"]
        assert terminated and not truncated and info["success"] is True and total == 1.0
        assert "*" in observation and "P" not in observation  # the player on the goal


def test_frozen_lake_observation_is_a_compact_ascii_grid():
    env = FrozenLakeEnv(size=4)
    observation, _ = env.reset(1)
    rows = observation.split("\n")
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert set(observation) <= set("P_OG\n") and observation.count("P") == 1
    assert observation.isascii()
    # grid_lookup / grid_vocab as in ROLL's SokobanDifferentGridVocab, keys as YAML may give them
    custom = FrozenLakeEnv(size=4, grid_lookup={"0": "A", 1: "."})
    obs, info = custom.reset(1)
    assert obs == observation.replace("P", "A").replace("_", ".") and "A player" in info["env_instruction"]


def test_frozen_lake_hole_and_fixed_map():
    env = FrozenLakeEnv(desc=["SH", "FG"], is_slippery=False)
    assert env.reset(0)[0] == "PO\n_G"
    observation, reward, terminated, truncated, info = env.step(answer("Right"))
    assert (observation, reward, terminated, truncated, info["success"]) == ("_X\n_G", 0.0, True, False, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(answer("Down"))
    env.reset(1)
    assert env.step(answer("Down"))[1:3] == (0.0, False) and env.step(answer("Right"))[1:3] == (1.0, True)


def test_frozen_lake_invalid_actions_cost_the_penalty_and_change_nothing():
    env = FrozenLakeEnv(desc=["SFF", "FHF", "FFG"], is_slippery=False, format_penalty=-0.05, max_steps=10)
    start, _ = env.reset(0)
    for text in ["Right", "<answer>Jump</answer>", "<answer></answer>", "", "<answer>Rightward</answer>"]:
        observation, reward, terminated, truncated, info = env.step(text)
        assert (observation, reward, terminated, truncated) == (start, -0.05, False, False)
        assert info["action_is_valid"] is False and info["metrics"]["action_is_valid"] == 0.0
    observation, reward, *_ = env.step("<|im_start|>" + answer(" right ") + "<|im_end|>")
    assert observation != start and reward == 0.0


def test_frozen_lake_think_pattern_takes_the_last_group_and_truncates_at_max_steps():
    env = FrozenLakeEnv(desc=["SFF", "FHF", "FFG"], is_slippery=False, max_steps=3,
                        action_pattern=r"<think>(.*?)</think>\s*<answer>(.*?)</answer>")
    env.reset(0)
    assert env.step("<think>go Down</think><answer>Right</answer>")[0].startswith("_P_")
    assert env.step(answer("Right"))[3] is False  # no think block: invalid, step 2 of 3
    observation, reward, terminated, truncated, info = env.step("<think>x</think><answer>Left</answer>")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_frozen_lake_slippery_ice_is_seeded():
    def play(seed):
        env = FrozenLakeEnv(desc=["FFFFF", "FFFFF", "FFSFF", "FFFFF", "FFFFG"], is_slippery=True, max_steps=6)
        env.reset(seed)
        return [env.step(answer("Up"))[0] for _ in range(4)]

    assert play(3) == play(3)
    # Moving Up from the middle: some seeds slip sideways (gymnasium's 1/3 rule)
    firsts = {play(seed)[0] for seed in range(12)}
    assert len(firsts) > 1


def test_frozen_lake_map_seed_fixes_the_map():
    env = FrozenLakeEnv(map_seed=5, is_slippery=False)
    assert env.reset(1)[0] == env.reset(2)[0]


# -- Sokoban --------------------------------------------------------------------------------------
def test_sokoban_is_deterministic_and_solvable():
    for seed in range(25):
        a = SokobanEnv(dim_room=(6, 6), num_boxes=1, search_depth=30, max_steps=100)
        b = SokobanEnv(dim_room=(6, 6), num_boxes=1, search_depth=30, max_steps=100)
        observation, info = a.reset(seed)
        assert (observation, info) == b.reset(seed)
        assert observation.isascii() and observation.count("X") == 1 and observation.count("O") + \
            observation.count("S") == 1
        solution = a.solve()
        assert solution, observation
        for move in solution:
            observation, reward, terminated, truncated, info = a.step(answer(move))
        assert terminated and info["success"] and reward == pytest.approx(-0.1 + 1 + 10)
        assert "*" in observation


def test_sokoban_two_boxes_and_roll_defaults_generate_quickly():
    env = SokobanEnv(dim_room=(7, 7), num_boxes=2, search_depth=40)
    for seed in range(5):
        observation, _ = env.reset(seed)
        assert observation.count("X") + observation.count("*") == 2 and env.solve() is not None
    SokobanEnv().reset(0)  # ROLL's defaults: 10x10, 4 boxes, search_depth 300 (bounded search)


def test_sokoban_rewards_invalid_actions_and_truncation():
    env = SokobanEnv(dim_room=(5, 6), num_boxes=1, max_steps=4, format_penalty=-0.15)
    env.reset(0)
    # A hand-made room: a box on its target beside the player, another box off its target.
    floor = {(r, c) for r in range(1, 4) for c in range(1, 5)}
    env.room = Room(5, 6, floor, frozenset({(2, 2), (3, 4)}), frozenset({(2, 2), (1, 3)}), (2, 1))
    start = env.render()
    assert start == "######\n#__X_#\n#P*__#\n#___O#\n######"
    observation, reward, terminated, truncated, info = env.step("push it")
    assert (observation, reward, terminated, info["action_is_valid"]) == (start, pytest.approx(-0.25), False, False)
    observation, reward, terminated, _, info = env.step(answer("Right"))  # box off its target
    assert observation == "######\n#__X_#\n#_SX_#\n#___O#\n######" and reward == pytest.approx(-1.1)
    assert info["metrics"]["action_is_effective"] == 1.0 and not terminated
    observation, reward, terminated, truncated, info = env.step(answer("U"))
    assert observation == "######\n#_PX_#\n#_OX_#\n#___O#\n######" and reward == pytest.approx(-0.1)
    observation, reward, terminated, truncated, info = env.step(answer("up"))  # into the wall: no move
    assert info["metrics"]["action_is_effective"] == 0.0
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_sokoban_refuses_a_room_too_small():
    with pytest.raises(ValueError, match="num_boxes"):
        SokobanEnv(dim_room=(4, 4), num_boxes=3)


# -- GuessTheNumber -------------------------------------------------------------------------------
def play_binary_search(env, seed):
    observation, info = env.reset(seed)
    low, high, seen = env.min_number, env.max_number, [observation]
    while True:
        guess = (low + high) // 2
        observation, reward, terminated, truncated, info = env.step(f"I think \\boxed{{{guess}}}")
        seen.append(observation)
        if terminated or truncated:
            return seen, reward, info
        assert observation == f"{guess}: {'higher' if env.number > guess else 'lower'}"
        low, high = (guess + 1, high) if env.number > guess else (low, guess - 1)


def test_guess_the_number_binary_search_wins_and_is_deterministic():
    for seed in range(10):
        seen, reward, info = play_binary_search(make_env("game:GuessTheNumber-v0", {"max_turns": 5}), seed)
        assert reward == 1.0 and info["success"] and seen[-1].endswith("correct!") and len(seen) <= 6
        assert seen == play_binary_search(make_env("guess_the_number", {"max_turns": 5}), seed)[0]


def test_guess_the_number_invalid_guesses_and_turn_limit():
    env = make_env("game:GuessTheNumber-v0-easy", {})
    assert (env.reset(3)[0], env.max_turns) == ("Guess 1-10.", 4)
    observation, reward, terminated, truncated, info = env.step("\\boxed{99}")
    assert (reward, terminated, info["action_is_valid"]) == (0.0, False, False) and "range" in observation
    wrong = 1 if env.number != 1 else 2
    env.step(f"\\boxed{{{wrong}}}")
    observation, reward, terminated, *_ = env.step(f"\\boxed{{{wrong}}}")
    assert "already" in observation and not terminated
    observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{wrong}}}")
    assert truncated and not info["success"] and reward == 0.0  # a repeated final guess earns nothing
    # GEM: no guess at all ends the episode with the format penalty, unless told otherwise
    env.reset(0)
    assert env.step("five")[1:3] == (-0.1, True)
    env = make_env("guess_the_number", {"invalid_action_ends": False, "max_turns": 2, "min_number": 1,
                                        "max_number": 11})
    env.reset(0)
    assert env.step("five")[1:4] == (-0.1, False, False)
    far = 1 if env.number > 6 else 11
    observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{far}}}")
    assert truncated and reward == pytest.approx(1 - abs(far - env.number) / 10)  # GEM's consolation


# -- math -----------------------------------------------------------------------------------------
def test_math_generated_problems_and_answers():
    env = make_env("roll_math", {})
    question, info = env.reset(11)
    assert question == make_env("math_python", {}).reset(11)[0] and question.startswith("What is ")
    assert "\\boxed{}" in info["env_instruction"]
    assert env.step(f"so \\boxed{{{env.answer}}}")[1:5] == (1.0, True, False, {"action_is_valid": True,
                                                                               "success": True,
                                                                               "metrics": {"action_is_valid": 1.0,
                                                                                           "success": 1.0}})
    env.reset(11)
    assert env.step("\\boxed{-99999}")[1:3] == (0.0, True)
    env.reset(11)
    observation, reward, terminated, truncated, info = env.step("thinking...")
    assert (reward, terminated, truncated, info["action_is_valid"]) == (0.0, False, True, False)
    env = make_env("roll_math", {"max_steps": 2, "format_penalty": -0.1})
    env.reset(1)
    assert env.step("hmm")[1:4] == (-0.1, False, False)
    assert env.step(f"\\boxed{{{env.answer}}}")[1] == 1.0


def test_math_dataset_file_and_answer_matching(tmp_path):
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "half of 1?", "answer": "\\frac{1}{2}"},
            {"problem": "thousand?", "answer": "1000"}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = make_env("roll_math", {"dataset_name": str(tmp_path), "mode": "val"})  # a folder: <split>.jsonl
    assert [env.reset(seed)[0] for seed in range(4)] == ["1+1?", "half of 1?", "thousand?", "1+1?"]
    env.reset(2)
    assert env.step("\\boxed{1,000}")[1] == 1.0
    assert answers_match("0.5", "\\frac{1}{2}") and not answers_match("0.4", "\\frac{1}{2}")
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    bad_key = env_problems("roll_math", {"dataset_path": str(path), "question_key": "q"})
    assert bad_key == []  # rows are read at reset, where a missing key is named
    with pytest.raises(ValueError, match="lacks"):
        make_env("roll_math", {"dataset_path": str(path), "question_key": "q"}).reset(0)


# -- registry -------------------------------------------------------------------------------------
def test_registry_builtins_and_errors():
    for name, path in ENV_TYPES.items():
        assert issubclass(import_object(path), Env), name
    problems = env_problems("frozen_lakee", {})
    assert len(problems) == 1 and "frozen_lakee" in problems[0] and "frozen_lake, sokoban" in problems[0]
    problems = env_problems("frozen_lake", {"size": 4, "slippery": False, "max_step": 3})
    assert len(problems) == 1 and "['max_step', 'slippery']" in problems[0] and "is_slippery" in problems[0]
    problems = env_problems("sokoban", {"action_pattern": "<answer>(.*?</answer>"})
    assert any("not a valid regular expression" in p for p in problems)
    problems = env_problems("frozen_lake", {"action_pattern": "<answer>.*?</answer>"})
    assert any("has no group" in p for p in problems)
    assert any("size" in p for p in env_problems("frozen_lake", {"size": 1}))
    assert env_problems("sokoban", {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 10, "format_penalty": -0.15,
                                    "action_pattern": "<answer>(.*?)</answer>", "search_depth": 30}) == []
    assert any("mapping" in p for p in env_problems("sokoban", ["dim_room"]))
    with pytest.raises(ValueError, match="unknown key"):
        make_env("frozen_lake", {"sise": 4})


def test_registry_user_env_by_class_path():
    assert env_problems("tests.test_envs:CountdownEnv", {"start": 2}) == []
    env = make_env("tests.test_envs.CountdownEnv", {"start": 2})
    assert env.reset(0)[0] == "2" and env.step("1")[1] == 1.0 and env.step("0")[2] is True
    problems = env_problems("tests.test_envs:CountdownEnv", {"begin": 2})
    assert problems and "['begin']" in problems[0] and "start" in problems[0]
    assert "not an environment class" in env_problems("tests.test_envs:NotAnEnv", {})[0]
    assert "does not import" in env_problems("tests.no_such_module:Env", {})[0]
    if importlib.util.find_spec("gem") is None:  # gem-llm does not install beside hydra
        assert "GEM env id" in env_problems("game:Wordle-v0", {})[0]
    assert "no attribute" in env_problems("tests.test_envs:Missing", {})[0]


# -- tools ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def python_tool():
    return PythonCodeTool(timeout=1.0, max_output_chars=300)


def test_python_tool_runs_code_in_the_sandbox(python_tool):
    env = ToolEnvWrapper(make_env("roll_math", {}), [python_tool], tool_reward=0.1, tool_success_reward=0.2)
    observation, info = env.reset(3)
    assert "<python>" in observation and info["use_tool"] is False
    assert env.answer == env.env.answer  # attributes are read through the wrapper
    observation, reward, terminated, truncated, info = env.step("Let me compute. <python>print(6*7)</python>")
    assert observation == "Code execution result: 42" and reward == pytest.approx(0.3)
    assert (terminated, truncated, info["use_tool"], info["tool_error"]) == (False, False, True, False)
    assert info["metrics"]["tool_use_counter"] == 1.0
    for text in ["```python\nprint(sum(range(5)))\n```", "<code>print('a' * 3)</code>"]:
        assert python_tool.execute_action(text)[:3] == (True, False, "Code execution result: " +
                                                         ("10" if "sum" in text else "aaa"))
    observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{env.answer}}}")
    assert (reward, terminated, info["use_tool"], info["success"]) == (1.0, True, False, True)
    assert python_tool.execute_action("no code here") == (False, False, "", "")


def test_python_tool_errors_and_hostile_code_are_contained(python_tool):
    call = python_tool.execute_action("<python>1/0</python>")
    assert call.parsed and call.error and "ZeroDivisionError" in call.observation
    shadow = python_tool.execute_action("<python>print(open('/etc/shadow').read())</python>")
    assert shadow.error and "root:" not in shadow.observation
    bomb = python_tool.execute_action("<python>import os\nwhile True:\n    os.fork()</python>")
    assert bomb.error
    outside = f"/work/roll_gspo_envs_probe_{uuid.uuid4().hex}"
    tmp_file = f"/tmp/roll_gspo_envs_probe_{uuid.uuid4().hex}"
    wrote = python_tool.execute_action(f"<python>open('{outside}', 'w').write('x')</python>")
    assert wrote.error and not os.path.exists(outside)
    private = python_tool.execute_action(f"<python>open('{tmp_file}', 'w').write('x'); print('ok')</python>")
    assert private[:3] == (True, False, "Code execution result: ok") and not os.path.exists(tmp_file)
    long = python_tool.execute_action("<python>print('y' * 5000)</python>")
    assert len(long.observation) == 300 and "more characters" in long.observation


def test_python_tool_hang_is_killed_at_the_timeout(python_tool):
    start = time.monotonic()
    call = python_tool.execute_action("<python>import time\ntime.sleep(120)</python>")
    assert call.error and "TimeoutError" in call.observation and time.monotonic() - start < 60


def test_function_tool_schema_and_calls():
    tool = FunctionTool(add)
    assert tool.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first addend."},
            "b": {"type": "integer", "description": "the second addend."}}, "required": ["a"]}}}
    assert FunctionTool(scale).schema["function"]["parameters"] == {
        "type": "object", "properties": {"values": {"type": "array", "items": {"type": "number"}},
                                         "factor": {"type": "number"}}, "required": ["values"]}
    assert '"name": "add"' in tool.instruction_string()
    call = tool.execute_action('sure <tool_call>{"name": "add", "arguments": {"a": 40}}</tool_call> done')
    assert call == (True, False, "42", 'sure <tool_call>{"name": "add", "arguments": {"a": 40}}</tool_call>')
    assert FunctionTool(scale).execute_action(
        '<tool_call>{"name": "scale", "arguments": "{\\"values\\": [1, 2], \\"factor\\": 0.5}"}</tool_call>'
    ).observation == '{"values": [0.5, 1.0]}'
    assert FunctionTool(scale).execute_action(
        '<tool_call>{"name": "scale", "arguments": {"values": [3], "factor": null}}</tool_call>').observation == \
        '{"values": [3.0]}'
    for text, message in [('<tool_call>{"name": add}</tool_call>', "not valid JSON"),
                          ('<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>', "unknown argument"),
                          ('<tool_call>{"name": "add", "arguments": {}}</tool_call>', "missing argument"),
                          ('<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>', "must be an integer"),
                          ('<tool_call>["add"]</tool_call>', "JSON object")]:
        call = tool.execute_action(text)
        assert call.parsed and call.error and message in call.observation, (text, call)
    assert tool.execute_action('<tool_call>{"name": "other", "arguments": {}}</tool_call>').parsed is False
    with pytest.raises(ValueError, match="no type hint"):
        FunctionTool(no_hints)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_function_tool_raising_and_hanging_calls_are_errors(isolation):
    call = FunctionTool(explode, isolation=isolation).execute_action(
        '<tool_call>{"name": "explode", "arguments": {"reason": "test"}}</tool_call>')
    assert call.error and call.observation == "RuntimeError: exploded: test"
    hang = spin if isolation == "process" else block  # a process is killed; a thread is abandoned
    RELEASE.clear()
    try:
        call = FunctionTool(hang, timeout=0.5, isolation=isolation).execute_action(
            f'<tool_call>{{"name": "{hang.__name__}", "arguments": {{"seconds": 1}}}}</tool_call>')
    finally:
        RELEASE.set()
    assert call.error and call.observation.startswith("TimeoutError")
    assert ("killed" if isolation == "process" else "abandoned") in call.observation


class BrokenTool(Tool):
    name = "broken"

    def instruction_string(self):
        return ""

    def execute_action(self, action):
        raise KeyError("bug")


def test_wrapper_first_claim_wins_errors_unknown_tools_and_max_tool_uses():
    tools = [FunctionTool(explode), FunctionTool(add, isolation="thread")]
    env = ToolEnvWrapper(make_env("roll_math", {"max_steps": 5}), tools, tool_reward=0.5,
                         tool_execute_error_reward=-1.0, max_tool_uses=3, tool_instruction_target="env_instruction")
    observation, info = env.reset(0)
    assert "Tool add" in info["env_instruction"] and "Tool" not in observation
    # Bad JSON: the first function tool reports it; no later tool hides the error (GEM would step the env)
    observation, reward, terminated, truncated, info = env.step('<tool_call>{"name": "add", </tool_call>')
    assert info["use_tool"] and info["tool_error"] and "not valid JSON" in observation and reward == -0.5
    observation, reward, _, _, info = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    assert info["tool_error"] and "no tool named 'mul'" in observation and "add" in observation
    observation, reward, _, _, info = env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert (observation.split("\n")[0], reward, info["tool_error"]) == ("3", 0.5, False)
    assert "No tool calls left" in observation and info["metrics"]["tool_use_counter"] == 3.0
    # After max_tool_uses the text goes to the env
    observation, reward, terminated, truncated, info = env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}'
                                                                '</tool_call>')
    assert info["use_tool"] is False and info["action_is_valid"] is False and not terminated
    assert info["metrics"]["tool_use_counter"] == 3.0
    broken = ToolEnvWrapper(make_env("roll_math", {}), [BrokenTool()])
    broken.reset(0)
    observation, reward, terminated, truncated, info = broken.step("anything")
    assert info["tool_error"] and "KeyError" in observation and not terminated


def test_calculator_is_exact_and_safe():
    assert [calculator(e) for e in ["12*(7+5)/3", "1/3", "2**10", "0.1+0.2", "-7//2", "2^3"]] == \
        ["48", "0.333333333333", "1024", "0.3", "-4", "8"]
    for bad in ["__import__('os').system('true')", "x + 1", "2**10**10", "1/0", "9" * 200, "(1).real", ""]:
        with pytest.raises(ValueError):
            calculator(bad)
    call = FunctionTool(calculator).execute_action(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert call[:3] == (True, False, "42")


def test_tool_configs_from_yaml():
    tool_wrapper = {"wrapper_args": {"tool_reward": 0.0, "tool_success_reward": 0.1, "max_tool_uses": 2},
                    "tool_configs": [{"tool_id": "python_code", "tool_args": {"timeout": 5, "sandbox_type": "none"}},
                                     {"tool_id": "function", "tool_args": {"function": "tests.test_envs:add",
                                                                           "timeout": 2}},
                                     {"tool_id": "calculator"},
                                     {"tool_id": "function", "tool_args": {
                                         "function": "roll_gspo.envs.tools:calculator", "name": "calc"}}]}
    assert wrapper_problems(tool_wrapper) == []
    env = wrap_with_tools(make_env("roll_math", {}), tool_wrapper)
    assert [t.name for t in env.tools] == ["python", "add", "calculator", "calc"] and env.max_tool_uses == 2
    assert wrap_with_tools(env.env, None) is env.env
    problems = tool_problems([{"tool_id": "pyhton_code"},
                              {"tool_id": "function", "tool_args": {"function": "tests.test_envs:no_hints"}},
                              {"tool_id": "function", "tool_args": {"function": "tests.test_envs:nothing"}},
                              {"tool_id": "python_code", "tool_args": {"timeout": 5, "sandbox": "bwrap"}},
                              {"tool_id": "python_code", "tool_args": {"sandbox_type": "docker"}},
                              {"tool_id": "function"},
                              {"tool_id": "function", "tool_args": {"function": "tests.test_envs:add", "timeout": 0}}])
    assert len(problems) == 7
    assert "tool_configs[0]" in problems[0] and "python_code, function, calculator" in problems[0]
    assert "no type hint" in problems[1] and "no attribute" in problems[2]
    assert "['sandbox']" in problems[3] and "sandbox_type" in problems[3]
    assert "docker" in problems[4] and "missing tool_args ['function']" in problems[5] and "timeout" in problems[6]
    bad = wrapper_problems({"wrapper_args": {"tool_rewards": 1}, "tool_configs": [{"tool_id": "calculator"}],
                            "extra": 1})
    assert len(bad) == 2 and "['extra']" in bad[0] and "['tool_rewards']" in bad[1]
    with pytest.raises(ValueError, match="tool_rewards"):
        wrap_with_tools(make_env("roll_math", {}), {"wrapper_args": {"tool_rewards": 1},
                                                   "tool_configs": [{"tool_id": "calculator"}]})
    assert len(build_tools([{"tool_id": "tests.test_envs:BrokenTool"}])) == 1
    assert isinstance(ToolCall(True, False, "x", "y"), tuple)
