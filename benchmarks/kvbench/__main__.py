"""`python -m kvbench <name> ...`: run a benchmark."""

from kvbench.cli import main

main()
