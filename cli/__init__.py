"""The `kvcupy` command: `repro`, `bench` and `info` (typer app in cli.app)."""
