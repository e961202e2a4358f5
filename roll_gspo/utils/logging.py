"""Console logging through rich, set up once per process (driver and Ray actors)."""
import logging
import os


def setup_logging(level: str = None) -> None:
    from rich.logging import RichHandler

    root = logging.getLogger("roll_gspo")
    if root.handlers:
        return
    root.setLevel(level or os.environ.get("ROLL_GSPO_LOG_LEVEL", "INFO"))
    handler = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.propagate = False
