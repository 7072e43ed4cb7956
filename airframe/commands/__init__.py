"""One module per `airframe` subcommand (see airframe/cli.py)."""
