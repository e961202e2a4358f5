"""Model-side helpers: loading a causal LM, per-token log-probs, MoE routing on the trainer."""
