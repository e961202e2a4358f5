"""Weight sync: trained weights -> every rollout rank, and the transports that carry them."""
