"""Data: prompt and SFT loading, prompt sampling, named chat templates."""
