"""One file per role: actor_train, actor_infer, reference, rewards."""
