"""The facts of the project's pluggable kinds, registered once: advantage estimators
(`estimators`), policy losses (`policy_losses`), reward workers (`reward_workers`) and the roles'
engines by `strategy_name` (`engines`).

The config checks, the schema's choices and help, placement and the code that dispatches a kind
all read these tables, so a new estimator, loss, reward worker or engine is declared in one entry
here. The package is torch-free and imports nothing of the project, which is what lets the schema
(below the algorithms' torch code) and placement (beside the rewards) read it.
"""
