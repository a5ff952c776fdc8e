"""``python -m lessons``: the series' command line (see :mod:`lessons.cli`)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
