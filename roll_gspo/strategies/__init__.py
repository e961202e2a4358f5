"""The engines a role's rank runs: the rollout engines behind the `RolloutEngine` contract
(`engine.py`: vLLM, transformers' `generate`) and the training engines (`train_engine.py`:
DeepSpeed ZeRO, torch FSDP2). Which `strategy_name` builds which class, and what each engine can
do, is `roll_gspo.catalog.engines`; `engine_class` imports the class on first use."""
from __future__ import annotations

import importlib

from roll_gspo.catalog.engines import ENGINES


def engine_class(strategy_name: str) -> type:
    """The class a role's `strategy_name` builds (the `_infer` training names build their engine
    frozen); a name the catalog does not hold raises ValueError naming those it does."""
    if strategy_name not in ENGINES:
        raise ValueError(f"strategy_name {strategy_name!r} names no engine; built: {', '.join(ENGINES)}")
    kind = ENGINES[strategy_name]
    return getattr(importlib.import_module(kind.path), kind.cls)
