"""Logging, set up once per process (driver and Ray actors).

The console gets one plain line per record, never wrapped (a terminal folds a long line only on
screen; a file piped from the run keeps it whole): rich's handler wraps its message column at the
terminal's width, or at 80 columns when the output is not a terminal, so it is not used.

Third-party output stays out of the console and goes to `<output_dir>/logs/` instead (the folder
is `ROLL_GSPO_LOG_DIR`, which the driver sets and hands to every rank), one file per process,
`<role>-<rank>-<pid>.log` (`driver-<pid>.log` for the driver):
- a Ray worker's whole stdout and stderr (`capture_output`: vLLM's and DeepSpeed's warnings,
  progress bars, C++ warnings of torch), so the only worker lines Ray forwards to the driver's
  console are roll_gspo's own records;
- in the driver, the same while a built-in model or task is built (transformers, DeepSpeed), and
  the records of libraries that log through the root logger, e.g. Ray's notices (token
  authentication, "Started a local Ray instance"); their errors still reach the console;
- Python FutureWarning / DeprecationWarning (e.g. torch.distributed's, once per step).
A worker that fails reaches the console as the driver's error, one line naming the rank and its log
file (a dead rank, or an exception raised in a rank's method, whose trace the rank writes there).
"""
import contextlib
import logging
import os
import sys

LOG_DIR_ENV = "ROLL_GSPO_LOG_DIR"
QUIET_WARNING_CATEGORIES = ("FutureWarning", "DeprecationWarning")
_FILE_HANDLERS = {}
_console = None  # while this process's stdout/stderr are captured: the console they had before


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


class ConsoleHandler(logging.StreamHandler):
    """Writes to the console this process has when a record is written: the real one while its
    stdout/stderr go to its log file (`capture_output`), else `sys.stderr` as it is then. Looked
    up per record, not kept: a stream kept from when the handler was made may have been replaced
    and closed since (a test harness capturing one test's output, an embedding program)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return _console or sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns one; the console is looked up instead
        pass


def console_handler(level: int = logging.NOTSET) -> logging.Handler:
    """A handler writing our one-line records to the console (the real one even while this
    process's own stdout/stderr go to its log file)."""
    handler = ConsoleHandler()
    handler.setFormatter(LineFormatter())
    handler.setLevel(level)
    return handler


def setup_logging(level: str = None) -> None:
    root = logging.getLogger("roll_gspo")
    if root.handlers:
        return
    root.setLevel(level or os.environ.get("ROLL_GSPO_LOG_LEVEL", "INFO"))
    root.addHandler(console_handler())
    root.propagate = False
    route_python_warnings()


def log_path(role: str = None, pid: int = None):
    """This process's log file (or that of rank `role` = `<role>-<rank>`, process `pid`) in
    ROLL_GSPO_LOG_DIR, or None when it is unset."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return None
    return os.path.join(folder, f"{role or os.environ.get('ROLL_GSPO_ROLE', 'driver')}-{pid or os.getpid()}.log")


def log_file():
    """A file handler on this process's log file, or None when ROLL_GSPO_LOG_DIR is unset."""
    path = log_path()
    if not path:
        return None
    if path not in _FILE_HANDLERS:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handler = logging.FileHandler(path, delay=True)  # no empty files
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        _FILE_HANDLERS[path] = handler
    return _FILE_HANDLERS[path]


def trace_to_log_file(message: str):
    """Write `message` (e.g. a traceback) as an ERROR record to this process's log file only, not
    to the console; returns the file, or None when ROLL_GSPO_LOG_DIR is unset."""
    handler = log_file()
    if handler is None:
        return None
    handler.handle(logging.LogRecord("roll_gspo.trace", logging.ERROR, __file__, 0, message, None, None))
    handler.flush()
    return log_path()


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
    console = console_handler()
    console.addFilter(_NotQuiet())
    logger.addHandler(console)
    file_handler = log_file()
    if file_handler is not None:
        logger.addHandler(file_handler)
    logger.propagate = False
    logger._roll_gspo_routed = True


def capture_output():
    """Send this process's stdout and stderr, at the file-descriptor level (C libraries and child
    processes included), to its log file; our console handlers keep writing to the console it
    had. Returns the function that undoes it, or None where there is nothing to do (no log
    folder, or already captured)."""
    global _console
    path = log_path()
    if path is None or _console is not None:
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in saved:
        os.dup2(target, fd)
    os.close(target)
    _console = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # a crash loses no buffered lines of the file

    def restore():
        global _console
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        console, _console = _console, None  # records from here on go to sys.stderr
        console.close()

    return restore


@contextlib.contextmanager
def output_in_log_file():
    """`capture_output` for the duration of a block (e.g. the driver building a built-in model)."""
    restore = capture_output()
    try:
        yield
    finally:
        if restore is not None:
            restore()


def configure_vllm_logging() -> None:
    """vLLM reads its logging setup when first imported: point it (VLLM_LOGGING_CONFIG_PATH,
    unless the user set one) at a config that writes its records from INFO up to this process's
    log file when its output is captured there, else its warnings and errors to the console."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    import hashlib
    import json
    import tempfile

    # While captured, stdout is the log file (one handler: no record twice in it).
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stdout",
               "level": "INFO" if _console is not None else "WARNING", "formatter": "plain"}
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
              "handlers": {"console": handler},
              "loggers": {"vllm": {"handlers": ["console"], "level": "INFO", "propagate": False}}}
    text = json.dumps(config, sort_keys=True)
    folder = os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir()
    path = os.path.join(folder, f"vllm_logging_{hashlib.sha1(text.encode()).hexdigest()[:12]}.json")
    if not os.path.exists(path):
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as handle:
            handle.write(text)
        os.replace(handle.name, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def keep_logs_in_file() -> None:
    """This process's roll_gspo records and Python warnings go to its log file too (besides the
    console)."""
    handler = log_file()
    for name in ("roll_gspo", "py.warnings"):
        logger = logging.getLogger(name)
        if handler is not None and handler not in logger.handlers:
            logger.addHandler(handler)


def use_log_dir(folder: str) -> None:
    """The driver's log folder: its own records go there too (besides the console), and every
    rank started afterwards writes its output there (ROLL_GSPO_LOG_DIR). Records of libraries
    that log through the root logger (Ray's: see `distributed.cluster.init_ray`) go there as
    well, and to the console only from ERROR up."""
    os.environ[LOG_DIR_ENV] = os.path.abspath(folder)
    keep_logs_in_file()
    root = logging.getLogger()
    handler = log_file()
    if handler not in root.handlers:
        root.addHandler(handler)
    if not getattr(root, "_roll_gspo_console", False):
        root.addHandler(console_handler(logging.ERROR))
        root._roll_gspo_console = True
