"""Multi-turn episodes for the agentic pipeline: token-in/token-out conversations (`tokens`), the
trajectory as the trainer sees it (`trajectory`), many episodes in flight against environments
(`rollout`), which episodes a step plays and their metrics (`episodes`), health warnings (`health`)."""
