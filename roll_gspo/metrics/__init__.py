"""Metrics out: the per-step metrics file and console line, and the trackers behind `track_with`."""
