"""The config steps (`registry.check`), one module per concern, their runner (`validate`) and `preflight`.

Every module of this folder but the runner, the registry and preflight declares steps. Run-time code
reads the run plan (`roll_gspo.config.plan`), never a module of this folder."""
