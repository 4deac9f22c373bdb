"""The `kora` command: a thin shell that each wing plugs its subcommands into."""
