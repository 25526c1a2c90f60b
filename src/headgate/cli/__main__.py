"""``python -m headgate.cli``: the ``headgate`` command, for tests and benchmarks that run
the source tree's interpreter without the installed console script."""

from headgate.cli import main

main()
