"""One module per ``nanoserve`` subcommand; see ``nanoserve.cli``."""
