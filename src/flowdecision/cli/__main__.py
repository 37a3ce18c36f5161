"""``python -m flowdecision.cli``."""

from . import main

main()
