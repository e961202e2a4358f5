"""The facts of the project's pluggable kinds, registered once: advantage estimators
(`estimators`) and reward workers (`reward_workers`).

The config checks, the schema's choices and help, placement and the code that dispatches a kind
all read these tables, so a new estimator or reward worker is declared in one line here. The
package is torch-free and imports nothing of the project, which is what lets the schema (below
the algorithms' torch code) and placement (beside the rewards) read it.
"""
