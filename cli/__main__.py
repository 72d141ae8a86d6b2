"""`python -m cli`: the same command as the `kvcupy` console script."""

from .app import app

app(prog_name="kvcupy")
