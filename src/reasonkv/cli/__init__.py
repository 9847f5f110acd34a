"""The `reasonkv` command line (typer). The app is assembled in `reasonkv.cli.main`."""
