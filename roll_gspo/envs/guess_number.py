"""GuessTheNumber: find a hidden integer from "higher"/"lower" hints.

The game GEM registers as ``game:GuessTheNumber-v0`` (ROLL's examples use it), with GEM's
semantics and keys (``min_number``, ``max_number``, ``max_turns``; None for the bounds draws them
per episode, as GEM's ``-random`` variant) and GEM's action format: the guess is the number in the
last ``\\boxed{...}`` of the turn (``action_pattern`` changes it; the last group that matched is
the guess).

Per turn:

* no guess found: ``format_penalty`` (GEM: -0.1) and, as in GEM, the episode ends
  (``invalid_action_ends: false`` keeps it going instead);
* a guess outside the range, or one already made: reward 0, ``action_is_valid`` False, the
  episode goes on;
* the hidden number: reward 1, terminated, success;
* otherwise the hint: ``"<guess>: higher"`` (the number is higher) or ``"<guess>: lower"``;
* after ``max_turns`` turns without finding it: truncated, and, as in GEM, a consolation reward
  ``1 - |guess - number| / (max_number - min_number)`` for the final turn's guess (0 when that
  guess was out of range or repeated, ``format_penalty`` when there was none).

Observations are short (the built-in character-level model holds 256 tokens); the rules go in
``info["env_instruction"]`` at reset, and ``info["suffix"]`` carries GEM's per-turn reminder.
"""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Optional, Set, Tuple

from roll_gspo.envs.base import (Env, as_float, compile_action_pattern, episode_rng, extract_action,
                                 positive_int)

DEFAULT_GUESS_PATTERN = r"\\boxed\{\s*(-?\d+)\s*\}"
SUFFIX = "Enter your next guess."


class GuessTheNumberEnv(Env):
    """GEM's GuessTheNumber; see the module docstring."""

    def __init__(self, min_number: Optional[int] = 1, max_number: Optional[int] = 20, max_turns: Optional[int] = 20,
                 action_pattern: str = DEFAULT_GUESS_PATTERN, format_penalty: float = -0.1,
                 invalid_action_ends: bool = True, env_instruction: Optional[str] = None):
        super().__init__()
        self.random_range = min_number is None or max_number is None
        if not self.random_range:
            if isinstance(min_number, bool) or isinstance(max_number, bool) or \
                    not isinstance(min_number, int) or not isinstance(max_number, int) or min_number >= max_number:
                raise ValueError(f"min_number and max_number must be integers with min_number < max_number, "
                                 f"got {min_number!r} and {max_number!r}")
        if max_turns is None and not self.random_range:
            raise ValueError("max_turns may be None only when min_number/max_number are None (drawn per episode)")
        self.config_turns = None if max_turns is None else positive_int(max_turns, "max_turns")
        self.config_range = (min_number, max_number)
        self.action_pattern = action_pattern
        self._pattern = compile_action_pattern(action_pattern)
        self.format_penalty = as_float(format_penalty, "format_penalty")
        self.invalid_action_ends = bool(invalid_action_ends)
        self.env_instruction = env_instruction
        self.min_number, self.max_number = (min_number or 1), (max_number or 2)
        self.max_turns = self.config_turns or 1
        self.number = self.min_number
        self.guesses: Set[int] = set()
        self.last_guess: Optional[int] = None
        self.turn = 0
        self.done = True

    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:
        rng = episode_rng(seed)
        if self.random_range:  # GEM's random variant: a small range and a binary-search turn budget
            self.min_number = rng.randint(1, 10)
            self.max_number = rng.randint(self.min_number + 5, self.min_number + 50)
        else:
            self.min_number, self.max_number = self.config_range  # type: ignore[assignment]
        self.max_turns = self.config_turns or math.ceil(math.sqrt(self.max_number - self.min_number)) + 1
        self.number = rng.randint(self.min_number, self.max_number)
        self.guesses, self.last_guess, self.turn, self.done = set(), None, 0, False
        observation = f"Guess {self.min_number}-{self.max_number}."
        return observation, {"env_instruction": self.instructions(), "suffix": SUFFIX}

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError("GuessTheNumberEnv.step after the episode ended: call reset() first")
        self.turn += 1
        text = extract_action(action, self._pattern, last_match=True)
        try:
            guess: Optional[int] = int(text) if text is not None else None
        except ValueError:
            guess = None
        info: Dict[str, Any] = {"suffix": SUFFIX}
        terminated = False
        if guess is None:
            observation, reward, valid = "No guess found.", self.format_penalty, False
            terminated = self.invalid_action_ends
        elif not self.min_number <= guess <= self.max_number:
            observation, reward, valid = f"{guess}: out of range.", 0.0, False
        elif guess in self.guesses:
            observation, reward, valid = f"{guess}: already guessed.", 0.0, False
        else:
            valid = True
            self.guesses.add(guess)
            self.last_guess = guess
            if guess == self.number:
                observation, reward, terminated = f"{guess}: correct!", 1.0, True
            else:
                observation, reward = f"{guess}: {'lower' if guess > self.number else 'higher'}", 0.0
        truncated = not terminated and self.turn >= self.max_turns
        if truncated:
            span = self.max_number - self.min_number
            reward = 1.0 - abs(self.last_guess - self.number) / span if self.last_guess is not None else 0.0
            if not valid:
                reward = self.format_penalty if guess is None else 0.0
        info["action_is_valid"] = valid
        info["metrics"] = {"action_is_valid": float(valid)}
        if terminated or truncated:
            self.done = True
            info["success"] = guess == self.number
            info["metrics"]["success"] = float(info["success"])
        return observation, float(reward), terminated, truncated, info

    def instructions(self) -> str:
        if self.env_instruction is not None:
            return self.env_instruction
        return (f"Guess the number between {self.min_number} and {self.max_number} (inclusive) in at most "
                f"{self.max_turns} turns. Each wrong guess gets a hint: higher or lower. Write your guess as "
                f"\\boxed{{number}}, e.g. \\boxed{{{(self.min_number + self.max_number) // 2}}}.")

    def sample_random_action(self) -> str:
        return "\\boxed{%d}" % random.randint(self.min_number, self.max_number)
