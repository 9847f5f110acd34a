"""The `reasonkv` command line (typer): shared helpers in `common`, one module per command
group, the app assembled in `main`."""
