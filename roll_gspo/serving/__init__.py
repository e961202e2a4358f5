"""The OpenAI-compatible rollout endpoint (docs/endpoint.md): `RolloutServer` in front of the
rollout ranks, recording each episode's token ids (`episodes`), over per-rank `backends`."""
