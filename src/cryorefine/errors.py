"""The one exception type for bad input: the CLI prints its message as one line and exits 2."""


class InputError(ValueError):
    """Bad user input: the message names the file, the column or value, and what to do."""
