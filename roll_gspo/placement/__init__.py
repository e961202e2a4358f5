"""Placement: which GPUs each role uses (`device_mapping`), colocation, and the memory plan
`--dry-run` prints. Pure decisions: no torch, no Ray."""
