"""The ``flashserve`` command line: shared engine arguments (``args``), ``generate``, and the
entry point (``main``), which adds the bench commands; ``server/cli.py`` adds ``serve``."""
