"""vLLM's sleep and wake-up between phases, for a rollout rank that shares its GPUs.

The engine is in one of three states:

    awake ----sleep()----> asleep ----wake_weights()----> weights ----wake_all()----> awake
      ^                      |                                                          |
      +------------------------------------- wake_all() --------------------------------+

`sleep` frees the KV cache and either moves the weights to CPU memory (level 1) or drops them
(level 2). A weight sync first wakes only the weights (the KV cache stays freed while the
buckets arrive), loads them, then wakes the KV cache; generation wakes everything first. After a
level-2 sleep the weights hold garbage until a sync: the config refuses level 2 unless every step
syncs (model_update_frequency 1), and `wake_all` refuses to run on garbage.

Where sleeping frees nothing (vLLM's CPU worker only logs "sleep mode is not supported on CPU")
the calls are skipped (`active` False); ROLL_GSPO_OFFLOAD_ON_CPU=1 makes them run on CPU anyway.
"""
from __future__ import annotations

AWAKE, ASLEEP, WEIGHTS = "awake", "asleep", "weights"


class EngineSleep:
    def __init__(self, llm, level: int, active: bool):
        self.llm = llm
        self.level = level
        self.active = active  # False: sleeping frees nothing here; every call is a no-op
        self.state = AWAKE
        self.weights_stale = False  # level 2 dropped them and no sync has refilled them yet

    def sleep(self) -> None:
        if not self.active or self.state == ASLEEP:
            return
        if self.state == WEIGHTS:  # half awake (a sync was interrupted): wake fully, then sleep
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.sleep(level=self.level)
        self.state = ASLEEP
        self.weights_stale = self.level >= 2

    def wake_weights(self) -> None:
        """Before a weight sync: the weights' memory back, the KV cache still freed."""
        if not self.active or self.state != ASLEEP:
            return
        self.llm.wake_up(tags=["weights"])
        self.state = WEIGHTS

    def weights_loaded(self) -> None:
        """A complete weight sync has refilled every weight."""
        self.weights_stale = False

    def wake_all(self) -> None:
        """Before generating or scoring (and at the end of a sync): everything back."""
        if not self.active or self.state == AWAKE:
            return
        if self.weights_stale:
            raise RuntimeError("vLLM slept at sleep_level 2, which drops its weights, and no weight sync has "
                               "refilled them; sleep_level 2 needs a sync after every sleep "
                               "(model_update_frequency: 1)")
        self.llm.wake_up(tags=["kv_cache"] if self.state == WEIGHTS else None)
        self.state = AWAKE
