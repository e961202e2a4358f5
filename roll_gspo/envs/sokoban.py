"""Sokoban as a text game: push every box onto a target.

ROLL's `sokoban` env (its keys are accepted: ``dim_room``, ``num_boxes``, ``search_depth``,
``max_steps``, ``action_pattern``, ``format_penalty``, ``grid_lookup``, ``grid_vocab``,
``action_lookup``, ``env_instruction``, ``special_token_list``, ``render_mode``), with its own
room generator instead of gym-sokoban's, so that generation is bounded in time and deterministic
per seed:

1. Topology: a random walk from a random inner cell carves floor (each step may turn, and may
   widen the corridor by one cell); the border is wall.
2. The boxes are put on random targets and the player on another floor cell: a solved state.
3. Reverse play: a breadth-first search from the solved state over reverse moves (the player
   steps to a free neighbour and may pull a box that was behind it), to at most
   ``search_depth`` moves and `MAX_SEARCH_STATES` states. Every state it reaches is solvable (its
   moves, reversed, are pushes that solve it). The puzzle is the reached state with the most
   boxes off target, then the most pulls, then the deepest, ties broken by the seed.
4. A room where no box could leave its target is redrawn, at most `MAX_ROOM_TRIES` times; then
   `reset` raises, naming the configuration (a room too small for its boxes).

Rewards as ROLL's (gym-sokoban's): -0.1 each step, +1 for pushing a box onto a target, -1 for
pushing one off, +10 when all boxes are on targets (terminated, success). An action that does not
parse costs the step penalty plus ``format_penalty`` and moves nothing (ROLL plays a no-op step).
Truncated at ``max_steps``.

Observation: the room, one ASCII character per cell (``#`` wall, ``_`` floor, ``O`` target,
``X`` box, ``*`` box on target, ``P`` player, ``S`` player on target; ROLL's ``√`` for a box on
a target is not ASCII, so ``*`` replaces it). Actions: Up/Down/Left/Right (any case) or U/D/L/R.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from roll_gspo.envs.base import DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, GridGameEnv, episode_rng, positive_int

Cell = Tuple[int, int]
# Cell codes of the renderer (ROLL's grid_lookup keys).
WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
DEFAULT_GRID = {WALL: "#", FLOOR: "_", TARGET: "O", BOX_ON_TARGET: "*", BOX: "X", PLAYER: "P",
                PLAYER_ON_TARGET: "S"}
DEFAULT_VOCAB = {"#": "wall", "_": "floor", "O": "target", "*": "box on target", "X": "box", "P": "player",
                 "S": "player on target"}
DEFAULT_ACTIONS = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}
MOVES = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
STEP_PENALTY, BOX_ON_REWARD, BOX_OFF_PENALTY, SOLVED_REWARD = -0.1, 1.0, -1.0, 10.0
MAX_SEARCH_STATES = 20000
MAX_ROOM_TRIES = 30


class Room:
    """A puzzle: walls/floor (`floor`), targets, boxes and the player."""

    def __init__(self, height: int, width: int, floor: Set[Cell], targets: FrozenSet[Cell],
                 boxes: FrozenSet[Cell], player: Cell):
        self.height, self.width = height, width
        self.floor, self.targets, self.boxes, self.player = floor, targets, boxes, player


def _carve(height: int, width: int, rng: random.Random) -> Set[Cell]:
    """Floor cells of a random-walk room with a wall border."""
    inner = lambda r, c: (min(max(r, 1), height - 2), min(max(c, 1), width - 2))  # noqa: E731
    position = (rng.randint(1, height - 2), rng.randint(1, width - 2))
    direction = rng.choice(list(MOVES.values()))
    floor = {position}
    for _ in range(int(1.7 * (height + width))):
        if rng.random() < 0.35:
            direction = rng.choice(list(MOVES.values()))
        position = inner(position[0] + direction[0], position[1] + direction[1])
        floor.add(position)
        if rng.random() < 0.5:  # widen: one side cell, so rooms are not all one-cell corridors
            side = (direction[1], direction[0]) if rng.random() < 0.5 else (-direction[1], -direction[0])
            floor.add(inner(position[0] + side[0], position[1] + side[1]))
    return floor


def _reverse_search(floor: Set[Cell], targets: FrozenSet[Cell], player: Cell, depth: int,
                    rng: random.Random) -> Tuple[FrozenSet[Cell], Cell, int]:
    """Reverse play from the solved state (see the module docstring): (boxes, player, boxes off
    target) of the chosen state."""
    start = (targets, player)
    queue = deque([(start, 0, 0)])
    seen = {start}
    best_key, best = None, []
    while queue:
        (boxes, position), moves, pulls = queue.popleft()
        key = (len(boxes - targets), pulls, moves)
        if best_key is None or key > best_key:
            best_key, best = key, [(boxes, position)]
        elif key == best_key:
            best.append((boxes, position))
        if moves >= depth:
            continue
        for dr, dc in MOVES.values():
            nxt = (position[0] + dr, position[1] + dc)
            if nxt not in floor or nxt in boxes:
                continue
            behind = (position[0] - dr, position[1] - dc)
            successors = [((boxes, nxt), pulls)]
            if behind in boxes:  # pull the box behind into the cell the player leaves
                successors.append((((boxes - {behind}) | {position}, nxt), pulls + 1))
            for state, pull_count in successors:
                if state not in seen and len(seen) < MAX_SEARCH_STATES:
                    seen.add(state)
                    queue.append((state, moves + 1, pull_count))
    boxes, position = rng.choice(best)
    return boxes, position, best_key[0]


def generate_room(dim_room: Tuple[int, int], num_boxes: int, search_depth: int, rng: random.Random) -> Room:
    """A solvable room (see the module docstring); RuntimeError after `MAX_ROOM_TRIES` rooms
    in which no box could be moved off its target."""
    height, width = dim_room
    for _ in range(MAX_ROOM_TRIES):
        floor = _carve(height, width, rng)
        if len(floor) < num_boxes + 2:
            continue
        cells = sorted(floor)
        picked = rng.sample(cells, num_boxes + 1)
        targets, player = frozenset(picked[:num_boxes]), picked[num_boxes]
        boxes, player, off = _reverse_search(floor, targets, player, search_depth, rng)
        if off > 0:
            return Room(height, width, floor, targets, boxes, player)
    raise RuntimeError(f"sokoban: no playable room in {MAX_ROOM_TRIES} tries for dim_room={list(dim_room)}, "
                       f"num_boxes={num_boxes}, search_depth={search_depth} (use a larger room, fewer boxes "
                       f"or a larger search_depth)")


class SokobanEnv(GridGameEnv):
    """Procedural Sokoban; see the module docstring for rules, rewards and keys."""

    def __init__(self, dim_room: Sequence[int] = (10, 10), num_boxes: int = 4, search_depth: int = 300,
                 max_steps: int = 20, action_pattern: str = DEFAULT_ACTION_PATTERN, format_penalty: float = 0.0,
                 env_instruction: Optional[str] = None, grid_lookup: Optional[Mapping[Any, str]] = None,
                 grid_vocab: Optional[Mapping[str, str]] = None, action_lookup: Optional[Mapping[Any, str]] = None,
                 special_token_list: Optional[Sequence[str]] = DEFAULT_SPECIAL_TOKENS, render_mode: str = "text"):
        super().__init__()
        try:
            dims = tuple(dim_room)
        except TypeError:
            dims = ()
        if len(dims) != 2:
            raise ValueError(f"dim_room must be [height, width], got {dim_room!r}")
        self.dim_room = (positive_int(dims[0], "dim_room[0]", 3), positive_int(dims[1], "dim_room[1]", 3))
        self.num_boxes = positive_int(num_boxes, "num_boxes")
        inner_cells = (self.dim_room[0] - 2) * (self.dim_room[1] - 2)
        if inner_cells < self.num_boxes + 2:
            raise ValueError(f"dim_room {list(self.dim_room)} has {inner_cells} inner cells: too few for "
                             f"num_boxes={self.num_boxes} boxes, a player and a free cell")
        self.search_depth = positive_int(search_depth, "search_depth")
        self.configure_text(max_steps=max_steps, action_pattern=action_pattern, format_penalty=format_penalty,
                            env_instruction=env_instruction, grid_lookup=grid_lookup, grid_vocab=grid_vocab,
                            action_lookup=action_lookup, special_token_list=special_token_list,
                            render_mode=render_mode, default_grid=DEFAULT_GRID, default_vocab=DEFAULT_VOCAB,
                            default_actions=DEFAULT_ACTIONS, moves=MOVES, moves_text="1 Up, 2 Down, 3 Left, 4 Right")
        self.room: Optional[Room] = None
        self.step_count = 0
        self.done = True

    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:
        self.room = generate_room(self.dim_room, self.num_boxes, self.search_depth, episode_rng(seed))
        self.step_count = 0
        self.done = False
        return self.render(), {"env_instruction": self.instructions()}

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:
        if self.done or self.room is None:
            raise RuntimeError("SokobanEnv.step after the episode ended: call reset() first")
        room = self.room
        self.step_count += 1
        code = self.action_code(action)
        reward, moved = STEP_PENALTY, False
        if code is None:
            reward += self.format_penalty
        else:
            dr, dc = MOVES[code]
            nxt = (room.player[0] + dr, room.player[1] + dc)
            if nxt in room.floor and nxt not in room.boxes:
                room.player, moved = nxt, True
            elif nxt in room.boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in room.floor and beyond not in room.boxes:
                    room.boxes = (room.boxes - {nxt}) | {beyond}
                    room.player, moved = nxt, True
                    if beyond in room.targets and nxt not in room.targets:
                        reward += BOX_ON_REWARD
                    elif nxt in room.targets and beyond not in room.targets:
                        reward += BOX_OFF_PENALTY
        solved = room.boxes == room.targets
        if solved:
            reward += SOLVED_REWARD
        truncated = not solved and self.step_count >= self.max_steps
        info: Dict[str, Any] = {"action_is_valid": code is not None,
                                "metrics": {"action_is_valid": float(code is not None),
                                            "action_is_effective": float(moved),
                                            "boxes_on_target": float(len(room.boxes & room.targets))}}
        if solved or truncated:
            self.done = True
            info["success"] = solved
            info["metrics"]["success"] = float(solved)
        return self.render(), reward, solved, truncated, info

    def cell_codes(self) -> List[List[int]]:
        """Each cell's renderer code (none before the first reset)."""
        room = self.room
        if room is None:
            return []
        rows = []
        for r in range(room.height):
            line = []
            for c in range(room.width):
                cell = (r, c)
                on_target = cell in room.targets
                if cell not in room.floor:
                    code = WALL
                elif cell == room.player:
                    code = PLAYER_ON_TARGET if on_target else PLAYER
                elif cell in room.boxes:
                    code = BOX_ON_TARGET if on_target else BOX
                else:
                    code = TARGET if on_target else FLOOR
                line.append(code)
            rows.append(line)
        return rows

    def game_text(self, legend: str, answer_format: str) -> str:
        return ("Sokoban: push every box onto a target. Walking into a box pushes it if the cell behind it is "
                f"free; boxes cannot be pulled. Symbols: {legend}. Actions: {self.actions.listing()}.{answer_format}")

    def solve(self, max_states: int = 200000) -> Optional[List[str]]:
        """A shortest action sequence solving the current room (breadth-first search over pushes
        and moves), or None if none is found within `max_states`. For tests and scripted data."""
        room = self.room
        if room is None:
            return None
        start = (room.boxes, room.player)
        queue, seen = deque([(start, [])]), {start}
        while queue:
            (boxes, player), path = queue.popleft()
            if boxes == room.targets:
                return path
            for code in sorted(self.actions.names):
                dr, dc = MOVES[code]
                nxt = (player[0] + dr, player[1] + dc)
                if nxt not in room.floor:
                    continue
                new_boxes = boxes
                if nxt in boxes:
                    beyond = (nxt[0] + dr, nxt[1] + dc)
                    if beyond not in room.floor or beyond in boxes:
                        continue
                    new_boxes = (boxes - {nxt}) | {beyond}
                state = (new_boxes, nxt)
                if state not in seen and len(seen) < max_states:
                    seen.add(state)
                    queue.append((state, path + [self.actions.names[code]]))
        return None
