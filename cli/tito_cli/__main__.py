"""`python -m tito_cli ...` is the `tito` command."""

from tito_cli.main import run

run()
