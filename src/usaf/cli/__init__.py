"""The ``usaf`` command line: Typer app, one module per command, heavy imports inside commands."""
