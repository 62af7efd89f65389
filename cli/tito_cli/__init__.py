"""The `tito` command: `tito serve render|engine|derender|all` and `tito chat` (see `main`)."""
