"""The inference peer a volunteer runs: `echo-node join ADDR --run-key FINGERPRINT --model FILE.gguf`.

- `cli`        typer entry point (heavy imports happen after argument parsing)
"""
