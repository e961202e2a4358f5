"""Logging, set up once per process (driver and Ray actors).

The console gets one plain line per record, never wrapped (a terminal folds a long line only on
screen; a file piped from the run keeps it whole): rich's handler wraps its message column at the
terminal's width, or at 80 columns when the output is not a terminal, so it is not used.

Third-party noise stays out of the console and goes to `<output_dir>/logs/` instead (the folder
is `ROLL_GSPO_LOG_DIR`, which the driver sets and hands to every rank): Python FutureWarning /
DeprecationWarning (e.g. torch.distributed's, once per step) and vLLM's INFO chatter (e.g.
"Successfully reset prefix cache" after every weight sync). vLLM's warnings and errors still
reach the console.
"""
import logging
import os
import sys

LOG_DIR_ENV = "ROLL_GSPO_LOG_DIR"
QUIET_WARNING_CATEGORIES = ("FutureWarning", "DeprecationWarning")
_FILE_HANDLERS = {}


class LineFormatter(logging.Formatter):
    """`HH:MM:SS message`, with the level named for warnings and errors; newlines in a message
    are kept (tracebacks), nothing else breaks a line."""

    def __init__(self):
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if record.levelno >= logging.WARNING:
            stamp, _, message = line.partition(" ")
            line = f"{stamp} {record.levelname} {message}"
        return line


def setup_logging(level: str = None) -> None:
    root = logging.getLogger("roll_gspo")
    if root.handlers:
        return
    root.setLevel(level or os.environ.get("ROLL_GSPO_LOG_LEVEL", "INFO"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter())
    root.addHandler(handler)
    root.propagate = False
    route_python_warnings()


def log_file(name: str = None):
    """A file handler in ROLL_GSPO_LOG_DIR (one file per process), or None when it is unset."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return None
    path = os.path.join(folder, name or f"{os.environ.get('ROLL_GSPO_ROLE', 'driver')}-{os.getpid()}.log")
    if path not in _FILE_HANDLERS:
        os.makedirs(folder, exist_ok=True)
        handler = logging.FileHandler(path, delay=True)  # no empty files
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        _FILE_HANDLERS[path] = handler
    return _FILE_HANDLERS[path]


class _NotQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(f" {category}: " in text or text.startswith(category) for category in QUIET_WARNING_CATEGORIES)


def route_python_warnings() -> None:
    """Python warnings go through logging: all to the log file, and to the console only those
    that are not FutureWarning / DeprecationWarning."""
    logger = logging.getLogger("py.warnings")
    if getattr(logger, "_roll_gspo_routed", False):
        return
    logging.captureWarnings(True)
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(_NotQuiet())
    logger.addHandler(console)
    file_handler = log_file()
    if file_handler is not None:
        logger.addHandler(file_handler)
    logger.propagate = False
    logger._roll_gspo_routed = True


def configure_vllm_logging() -> None:
    """vLLM reads its logging setup when first imported: point it (VLLM_LOGGING_CONFIG_PATH,
    unless the user set one) at a config whose console handler shows WARNING and above and whose
    file handler, when ROLL_GSPO_LOG_DIR is set, keeps everything from INFO up."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    import hashlib
    import json
    import tempfile

    folder = os.environ.get(LOG_DIR_ENV)
    handlers = {"console": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "level": "WARNING",
                            "formatter": "plain"}}
    if folder:
        os.makedirs(folder, exist_ok=True)
        handlers["file"] = {"class": "logging.FileHandler", "level": "INFO", "formatter": "plain",
                            "filename": os.path.join(folder, f"vllm-{os.environ.get('ROLL_GSPO_ROLE', 'driver')}-{os.getpid()}.log")}
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
              "handlers": handlers,
              "loggers": {"vllm": {"handlers": list(handlers), "level": "INFO", "propagate": False}}}
    text = json.dumps(config, sort_keys=True)
    name = f"vllm_logging_{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    path = os.path.join(folder or tempfile.gettempdir(), name)
    if not os.path.exists(path):
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as handle:
            handle.write(text)
        os.replace(handle.name, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def use_log_dir(folder: str) -> None:
    """The driver's log folder: its own records go there too (besides the console), and every
    rank started afterwards writes its third-party noise there (ROLL_GSPO_LOG_DIR)."""
    os.environ[LOG_DIR_ENV] = os.path.abspath(folder)
    handler = log_file()
    for name in ("roll_gspo", "py.warnings"):
        logger = logging.getLogger(name)
        if handler not in logger.handlers:
            logger.addHandler(handler)
