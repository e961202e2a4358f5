"""The environment interface of the agentic pipeline: GEM's text-in, text-out protocol.

An environment is played one episode at a time, by text::

    observation, info = env.reset(seed)                      # seed fixes the episode (map, problem)
    observation, reward, terminated, truncated, info = env.step(action_text)

`action_text` is what the model generated for the turn, verbatim (the env parses its action out
of it); `observation` is text the pipeline tokenises and appends to the trajectory. The class is
a `gymnasium.Env` so gymnasium tooling recognises it; it is not GEM's `gem.core.Env` because GEM
(`gem-llm`) does not install beside this stack (it pins nltk 3.9.1 and antlr4 4.13, which
omegaconf/hydra refuse), so the protocol is implemented here, with the same method names and
return values: a GEM env, or any class with `reset`/`step` like these, plugs in unchanged.

`reset` info keys (all optional):

* ``env_instruction`` (str): text shown once before the first observation (rules, symbols,
  action format). Kept out of the observation so a template can place it (ROLL does the same).
* ``suffix`` (str): GEM's per-turn reminder ("Enter your next guess."), for templates that use
  ``{suffix}``.

`step` info keys (all optional; an env returns the ones that apply):

* ``action_is_valid`` (bool): the action text parsed to a legal action. False: the pattern did
  not match, or it named no action, or the action is illegal here (the env then charges its
  ``format_penalty`` and, for the grid games, leaves the state unchanged).
* ``success`` (bool): set on the step that ends the episode: whether the task was solved.
* ``use_tool`` (bool): the step was a tool call (`tools.ToolEnvWrapper`); the observation is the
  tool's result, not the environment's.
* ``tool_error`` (bool): with ``use_tool``, the call failed (bad call, error, timeout).
* ``metrics`` (dict name -> float): per-step numbers for logging, e.g. ``action_is_effective``.

`terminated`: the episode reached an end state of the task (goal, hole, answer given);
`truncated`: it was cut by the env's own step limit (``max_steps`` / ``max_turns``). The
pipeline's turn cap (``custom_envs.<tag>.max_steps``) is separate and enforced by the pipeline.

The helpers below are shared by the built-in envs: action parsing by regex (ROLL's
``action_pattern``), action-name lookup, per-episode random generators and code->character maps
for the grid renderers.
"""
from __future__ import annotations

import random
import re
from typing import Any, Dict, List, Mapping, Optional, Pattern, Sequence, Tuple

import gymnasium

# ROLL's default: the action is what the model writes between <answer> tags.
DEFAULT_ACTION_PATTERN = r"<answer>(.*?)</answer>"
# Chat special tokens ROLL removes from the action text before parsing (a decoded turn may end
# with the end-of-turn token).
DEFAULT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")

STEP_INFO_KEYS = ("action_is_valid", "success", "use_tool", "tool_error", "metrics")
RESET_INFO_KEYS = ("env_instruction", "suffix")


class Env(gymnasium.Env):
    """Base class of the text environments (GEM's protocol; see the module docstring).

    Subclasses implement `reset` and `step` with exactly these signatures. An env object plays
    one episode at a time and is not shared between threads.
    """

    metadata = {"render_modes": ["text"]}

    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:  # type: ignore[override]
        """Start an episode; the same seed gives the same episode. Returns (observation, info)."""
        raise NotImplementedError

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:  # type: ignore[override]
        """Play the model's turn text. Returns (observation, reward, terminated, truncated, info)."""
        raise NotImplementedError

    def sample_random_action(self) -> str:
        """A random well-formed action text (GEM's helper; for smoke tests and baselines)."""
        raise NotImplementedError


class GridGameEnv(Env):
    """An Env whose state is a grid of symbols and whose turn is one named move (FrozenLake,
    Sokoban): ROLL's shared text keys (`grid_lookup`, `grid_vocab`, `action_lookup`,
    `action_pattern`, `format_penalty`, `special_token_list`, ...) read and checked in one place."""

    def configure_text(self, *, max_steps: Any, action_pattern: str, format_penalty: Any,
                       env_instruction: Optional[str], grid_lookup: Optional[Mapping[Any, str]],
                       grid_vocab: Optional[Mapping[str, str]], action_lookup: Optional[Mapping[Any, str]],
                       special_token_list: Optional[Sequence[str]], render_mode: str,
                       default_grid: Mapping[int, str], default_vocab: Mapping[str, str],
                       default_actions: Mapping[int, str], moves: Mapping[int, Any], moves_text: str) -> None:
        """Check and set the text keys; `moves` are the action codes the game knows (`moves_text`
        names them in the error for an `action_lookup` code outside them)."""
        self.max_steps = positive_int(max_steps, "max_steps")
        self.action_pattern = action_pattern
        self._pattern = compile_action_pattern(action_pattern)
        self.format_penalty = as_float(format_penalty, "format_penalty")
        self.grid_chars = code_chars(grid_lookup, default_grid, "grid_lookup")
        self.grid_vocab = symbol_legend(self.grid_chars, default_grid, default_vocab, grid_vocab)
        self.actions = ActionNames(action_lookup if action_lookup is not None else default_actions)
        unknown = sorted(set(self.actions.names) - set(moves))
        if unknown:
            raise ValueError(f"action_lookup: codes {unknown} are not moves ({moves_text})")
        self.special_tokens = tuple(text_list(special_token_list, "special_token_list"))
        if render_mode != "text":
            raise ValueError(f"render_mode {render_mode!r}: only 'text' is supported")
        self.render_mode = render_mode
        self.env_instruction = env_instruction

    def action_code(self, text: str) -> Optional[int]:
        """The move a turn's text names (None: no well-formed action in it)."""
        return self.actions.code(extract_action(text, self._pattern, special_tokens=self.special_tokens))

    def cell_codes(self) -> List[List[int]]:
        """The grid as renderer codes (`grid_lookup`'s keys), row by row."""
        raise NotImplementedError

    def game_text(self, legend: str, answer_format: str) -> str:
        """The game's instructions around its symbol legend and answer-format sentence."""
        raise NotImplementedError

    def render(self) -> str:
        """The grid, one character per cell, rows separated by newlines."""
        return "\n".join("".join(self.grid_chars[code] for code in row) for row in self.cell_codes())

    def instructions(self) -> str:
        """`env_instruction` when given, else the game's own text."""
        if self.env_instruction is not None:
            return self.env_instruction
        legend = ", ".join(f"{k} {v}" for k, v in self.grid_vocab.items())
        answer_format = (" Answer with one action, e.g. <answer>Right</answer>."
                         if self.action_pattern == DEFAULT_ACTION_PATTERN else " Answer with one action.")
        return self.game_text(legend, answer_format)

    def sample_random_action(self) -> str:
        return f"<answer>{random.choice(list(self.actions.names.values()))}</answer>"



def is_env_like(obj: Any) -> bool:
    """Whether `obj` (a class or instance) has callable `reset` and `step`: the duck type a user's
    environment class must satisfy (it need not subclass `Env`)."""
    return callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))


# -- actions ------------------------------------------------------------------------------------
def action_pattern_problem(pattern: Any, key: str = "action_pattern") -> Optional[str]:
    """What is wrong with an action regex (not a string, does not compile, has no group), else None."""
    if not isinstance(pattern, str) or not pattern:
        return f"{key} must be a non-empty regular expression string, got {pattern!r}"
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        return f"{key} {pattern!r} is not a valid regular expression: {exc}"
    if compiled.groups == 0:
        return (f"{key} {pattern!r} has no group: put the action in parentheses, e.g. "
                f"{DEFAULT_ACTION_PATTERN!r}")
    return None


def compile_action_pattern(pattern: str, key: str = "action_pattern") -> Pattern[str]:
    """The compiled regex (DOTALL, as ROLL); ValueError naming `key` when it is unusable."""
    problem = action_pattern_problem(pattern, key)
    if problem:
        raise ValueError(problem)
    return re.compile(pattern, re.DOTALL)


def extract_action(text: Any, pattern: Pattern[str], *, last_match: bool = False,
                   special_tokens: Sequence[str] = ()) -> Optional[str]:
    """The action text inside `text`: of the first match of `pattern` (the last with
    `last_match`), the last group that matched, stripped; None when nothing matches.

    "Last group" lets a pattern capture reasoning first and the action second (ROLL's
    ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>``).
    """
    text = "" if text is None else str(text)
    for token in special_tokens or ():
        text = text.replace(token, "")
    if last_match:
        matches = list(pattern.finditer(text))
        match = matches[-1] if matches else None
    else:
        match = pattern.search(text)
    if match is None:
        return None
    groups = [g for g in match.groups() if g is not None]
    return groups[-1].strip() if groups else None


class ActionNames:
    """Action code <-> name: matches names case-insensitively, and single letters (the names'
    initials) when those are unambiguous. ``lookup`` is ROLL's ``action_lookup`` ({code: name})."""

    def __init__(self, lookup: Mapping[Any, str], key: str = "action_lookup"):
        if not isinstance(lookup, Mapping) or not lookup:
            raise ValueError(f"{key} must be a non-empty mapping {{code: name}}, got {lookup!r}")
        self.names: Dict[int, str] = {}
        for code, name in lookup.items():
            try:
                number = int(code)
            except (TypeError, ValueError):
                raise ValueError(f"{key}: code {code!r} is not an integer") from None
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{key}: the name of action {code!r} must be a non-empty string")
            self.names[number] = name.strip()
        self._by_text: Dict[str, int] = {name.lower(): code for code, name in self.names.items()}
        initials = [name[0].lower() for name in self.names.values()]
        if len(set(initials)) == len(initials):
            for code, name in self.names.items():
                self._by_text.setdefault(name[0].lower(), code)

    def code(self, text: Optional[str]) -> Optional[int]:
        """The action code `text` names, or None."""
        if text is None:
            return None
        return self._by_text.get(text.strip().lower())

    def listing(self) -> str:
        return ", ".join(self.names.values())


def code_chars(user: Optional[Mapping[Any, Any]], default: Mapping[int, str], key: str) -> Dict[int, str]:
    """A renderer's {cell code: text} (ROLL's ``grid_lookup``): `default` overridden by `user`,
    whose keys may be ints or digit strings (YAML)."""
    out = dict(default)
    if user is None:
        return out
    if not isinstance(user, Mapping):
        raise ValueError(f"{key} must be a mapping {{cell code: character}}, got {user!r}")
    for code, char in user.items():
        try:
            number = int(code)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: code {code!r} is not an integer (valid: {sorted(default)})") from None
        if number not in default:
            raise ValueError(f"{key}: unknown cell code {number} (valid: {sorted(default)})")
        if not isinstance(char, str) or not char:
            raise ValueError(f"{key}: the text of code {number} must be a non-empty string")
        out[number] = char
    return out


def symbol_legend(chars: Mapping[int, str], default_chars: Mapping[int, str], default_vocab: Mapping[str, str],
                  user_vocab: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """{character: meaning} for the instruction (ROLL's ``grid_vocab``): the user's, else the
    default meanings moved onto the characters actually used."""
    if user_vocab is not None:
        if not isinstance(user_vocab, Mapping):
            raise ValueError(f"grid_vocab must be a mapping {{character: meaning}}, got {user_vocab!r}")
        return {str(k): str(v) for k, v in user_vocab.items()}
    return {chars[code]: default_vocab[default_chars[code]] for code in default_chars}


def episode_rng(seed: Optional[int]) -> random.Random:
    """The episode's random generator: fixed by `seed`, fresh entropy when None."""
    if seed is None:
        return random.Random()
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            seed = int(seed)
        except (TypeError, ValueError):
            raise ValueError(f"seed must be an integer or None, got {seed!r}") from None
    return random.Random(seed)


def positive_int(value: Any, key: str, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`; ValueError naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def text_list(value: Any, key: str) -> List[str]:
    """A list of strings (YAML list or tuple); ValueError naming `key` otherwise."""
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings, got {value!r}")
    return list(value)
