"""The `deepserve` command: thin modules that parse arguments, call the library and print. No logic here."""
