"""``python -m bubblefree`` is the ``bubblefree`` command."""

import sys

from bubblefree.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
