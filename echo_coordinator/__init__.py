"""Launching and running a run: `echo-coordinator start`, `echo-coordinator status`.

- `cli`        typer entry point (heavy imports happen after argument parsing)
"""
