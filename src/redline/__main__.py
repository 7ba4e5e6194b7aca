"""`python -m redline` runs the command line."""

from redline.cli.main import main

main()
