"""``python -m kvfs`` is the ``kvfs`` command."""

from kvfs.cli import main

main()
