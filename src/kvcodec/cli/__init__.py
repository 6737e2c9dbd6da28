"""The `kvcodec` command line. Each subcommand lives in its own module of this package."""
