"""The evaluation command's input errors."""


class EvalInputError(ValueError):
    """What `python -m roll_gspo.eval` was given cannot be evaluated (the message names the
    argument): the command prints it as one line, not a trace."""
