"""FrozenLake as a text game: walk from the start to the goal on a grid without falling into a hole.

ROLL's `frozen_lake` env (its constructor keys are accepted: ``size``, ``p``, ``is_slippery``,
``map_seed``, ``max_steps``, ``action_pattern``, ``format_penalty``, ``env_instruction``,
``grid_lookup``, ``grid_vocab``, ``action_lookup``, ``special_token_list``, ``render_mode``),
written here without gymnasium's toy-text class so that it is a few dozen lines and fully
deterministic per seed. Differences from ROLL, each deliberate:

* The observation is the grid only, one ASCII character per cell, rows on separate lines
  (``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal, ``X`` player in a hole, ``*`` player on
  the goal; ROLL's ``√`` is not ASCII and would be an unknown token for the built-in
  character-level model). Rules, symbols and the action format go to ``info["env_instruction"]``
  at reset, so a 4x4 board costs 19 tokens a turn.
* Actions: ROLL's names (Left/Down/Right/Up, any case) and their initials L/D/R/U.
* An action that does not parse costs ``format_penalty``, leaves the state as it was and does not
  end the episode; every step, valid or not, counts towards ``max_steps`` (else a model that never
  writes a valid action would never be truncated).
* ``desc`` (gymnasium's key: rows of ``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal) gives a
  fixed map; ``map_seed`` a fixed generated map; otherwise each reset seed generates its own.

Maps are generated as ROLL does (start and goal anywhere, each other cell frozen with
probability ``p``) and are always solvable: a map without a path is redrawn, and after a bounded
number of draws a path is carved, so generation always ends.

Slippery ice (gymnasium's rule): the move goes the intended way or to either side of it, each
with probability 1/3, drawn from the episode's generator (so a seed fixes the slips too).
Rewards: 1 on reaching the goal (terminated, success), 0 in a hole (terminated, no success),
0 otherwise, ``format_penalty`` for an action that does not parse.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from roll_gspo.envs.base import (DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, GridGameEnv, as_float, episode_rng,
                                 positive_int, text_list)

# Cell codes of the renderer (ROLL's grid_lookup keys).
PLAYER, FROZEN, HOLE, GOAL, PLAYER_IN_HOLE, PLAYER_ON_GOAL = range(6)
DEFAULT_GRID = {PLAYER: "P", FROZEN: "_", HOLE: "O", GOAL: "G", PLAYER_IN_HOLE: "X", PLAYER_ON_GOAL: "*"}
DEFAULT_VOCAB = {"P": "player", "_": "frozen ice", "O": "hole", "G": "goal", "X": "player in a hole",
                 "*": "player on the goal"}
# ROLL's action codes; the direction of each as (row, column) change.
DEFAULT_ACTIONS = {0: "Left", 1: "Down", 2: "Right", 3: "Up"}
MOVES = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
MAP_LETTERS = "SFHG"
MAX_MAP_DRAWS = 200


def _reachable(board: Sequence[str], start: Tuple[int, int]) -> bool:
    """Whether the goal can be reached from `start` stepping on non-hole cells."""
    rows, cols = len(board), len(board[0])
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if board[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and (nr, nc) not in seen and board[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def generate_random_map(size: int = 4, p: float = 0.8, rng: Optional[random.Random] = None) -> List[str]:
    """A solvable `size` x `size` map (rows of S/F/H/G): start and goal at distinct random cells,
    every other cell frozen with probability `p`. Draws until the goal is reachable; after
    `MAX_MAP_DRAWS` draws (only likely when `p` is small) carves a row-then-column path."""
    if size < 2:
        raise ValueError(f"size must be >= 2, got {size}")
    rng = rng or random.Random()
    cells = [(r, c) for r in range(size) for c in range(size)]
    for draw in range(MAX_MAP_DRAWS + 1):
        board = [["F" if rng.random() < p else "H" for _ in range(size)] for _ in range(size)]
        (sr, sc), (gr, gc) = rng.sample(cells, 2)
        board[sr][sc], board[gr][gc] = "S", "G"
        if draw == MAX_MAP_DRAWS:  # carve: along the start's row to the goal's column, then down/up
            step = 1 if gc >= sc else -1
            for c in range(sc, gc + step, step):
                if board[sr][c] == "H":
                    board[sr][c] = "F"
            step = 1 if gr >= sr else -1
            for r in range(sr, gr + step, step):
                if board[r][gc] == "H":
                    board[r][gc] = "F"
        rows = ["".join(row) for row in board]
        if _reachable(rows, (sr, sc)):
            return rows
    raise AssertionError("unreachable: the carved map always has a path")


def check_desc(desc: Any) -> List[str]:
    """A fixed map as a list of equal-length rows of S/F/H/G with one S and one G; ValueError
    naming what is wrong."""
    rows = text_list(desc, "desc")
    if not rows or any(len(row) != len(rows[0]) for row in rows) or not rows[0]:
        raise ValueError(f"desc must be non-empty rows of equal length, got {desc!r}")
    bad = sorted({ch for row in rows for ch in row} - set(MAP_LETTERS))
    if bad:
        raise ValueError(f"desc: unknown cell letters {bad} (valid: S start, F frozen, H hole, G goal)")
    text = "".join(rows)
    if text.count("S") != 1 or text.count("G") < 1:
        raise ValueError("desc needs exactly one start S and at least one goal G")
    return rows


class FrozenLakeEnv(GridGameEnv):
    """FrozenLake with procedural maps; see the module docstring for rules and keys."""

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True, map_seed: Optional[int] = None,
                 desc: Optional[Sequence[str]] = None, max_steps: int = 20,
                 action_pattern: str = DEFAULT_ACTION_PATTERN, format_penalty: float = 0.0,
                 env_instruction: Optional[str] = None, grid_lookup: Optional[Mapping[Any, str]] = None,
                 grid_vocab: Optional[Mapping[str, str]] = None, action_lookup: Optional[Mapping[Any, str]] = None,
                 special_token_list: Optional[Sequence[str]] = DEFAULT_SPECIAL_TOKENS, render_mode: str = "text"):
        super().__init__()
        self.size = positive_int(size, "size", 2)
        self.p = as_float(p, "p")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p (probability that a cell is frozen) must be in (0, 1], got {p!r}")
        self.is_slippery = bool(is_slippery)
        self.map_seed = map_seed
        self.fixed_desc = check_desc(desc) if desc is not None else None
        self.configure_text(max_steps=max_steps, action_pattern=action_pattern, format_penalty=format_penalty,
                            env_instruction=env_instruction, grid_lookup=grid_lookup, grid_vocab=grid_vocab,
                            action_lookup=action_lookup, special_token_list=special_token_list,
                            render_mode=render_mode, default_grid=DEFAULT_GRID, default_vocab=DEFAULT_VOCAB,
                            default_actions=DEFAULT_ACTIONS, moves=MOVES, moves_text="0 Left, 1 Down, 2 Right, 3 Up")
        self.desc: List[str] = []
        self.position = (0, 0)
        self.step_count = 0
        self.done = True
        self._rng = random.Random()

    # -- episode ------------------------------------------------------------------------------------
    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:
        self._rng = episode_rng(seed)
        if self.fixed_desc is not None:
            self.desc = list(self.fixed_desc)
        elif self.map_seed is not None:
            self.desc = generate_random_map(self.size, self.p, random.Random(self.map_seed))
        else:
            self.desc = generate_random_map(self.size, self.p, self._rng)
        start = "".join(self.desc).index("S")
        self.position = divmod(start, len(self.desc[0]))
        self.step_count = 0
        self.done = False
        return self.render(), {"env_instruction": self.instructions()}

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError("FrozenLakeEnv.step after the episode ended: call reset() first")
        self.step_count += 1
        code = self.action_code(action)
        info: Dict[str, Any] = {"action_is_valid": code is not None}
        if code is None:
            reward, terminated, moved = self.format_penalty, False, False
        else:
            if self.is_slippery:
                code = self._rng.choice([(code - 1) % 4, code, (code + 1) % 4])
            before = self.position
            self.position = self._moved(before, code)
            moved = self.position != before
            cell = self.desc[self.position[0]][self.position[1]]
            terminated = cell in "GH"
            reward = 1.0 if cell == "G" else 0.0
        truncated = not terminated and self.step_count >= self.max_steps
        info["metrics"] = {"action_is_valid": float(code is not None), "action_is_effective": float(moved)}
        if terminated or truncated:
            self.done = True
            info["success"] = self.cell() == "G"
            info["metrics"]["success"] = float(info["success"])
        return self.render(), reward, terminated, truncated, info

    def _moved(self, position: Tuple[int, int], code: int) -> Tuple[int, int]:
        dr, dc = MOVES[code]
        r, c = position[0] + dr, position[1] + dc
        if 0 <= r < len(self.desc) and 0 <= c < len(self.desc[0]):
            return r, c
        return position  # walking into the edge: stay

    # -- text -----------------------------------------------------------------------------------------
    def cell(self) -> str:
        """The map letter under the player (S/F/H/G)."""
        return self.desc[self.position[0]][self.position[1]]

    def cell_codes(self) -> List[List[int]]:
        """Each cell's renderer code, the player's cell marked (in a hole, on the goal)."""
        codes = {"S": FROZEN, "F": FROZEN, "H": HOLE, "G": GOAL}
        return [[{"H": PLAYER_IN_HOLE, "G": PLAYER_ON_GOAL}.get(letter, PLAYER) if (r, c) == self.position
                 else codes[letter] for c, letter in enumerate(row)] for r, row in enumerate(self.desc)]

    def game_text(self, legend: str, answer_format: str) -> str:
        slip = " The ice is slippery: a move may go sideways." if self.is_slippery else ""
        return (f"FrozenLake: move the player to the goal without falling into a hole.{slip}"
                f" Symbols: {legend}. Actions: {self.actions.listing()}.{answer_format}")

    def shortest_path(self) -> Optional[List[str]]:
        """Action names of a shortest path from the player to a goal on this map (ignoring slips);
        None if there is none. For tests, scripted baselines and SFT warm-start data."""
        queue, seen = deque([(self.position, [])]), {self.position}
        while queue:
            position, path = queue.popleft()
            if self.desc[position[0]][position[1]] == "G":
                return path
            if self.desc[position[0]][position[1]] == "H":
                continue
            for code in sorted(self.actions.names):
                nxt = self._moved(position, code)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append((nxt, path + [self.actions.names[code]]))
        return None
