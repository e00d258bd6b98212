"""Command-line workflows: `probe <command>` or `python scripts/<command>.py`."""
