"""The `inferengine` command and its subcommands."""
