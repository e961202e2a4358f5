"""What a run decides from its keys: the frozen `RunPlan` and the rules it is derived by."""
