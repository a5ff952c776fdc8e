"""``python -m lessons``: the series' command line (see :mod:`lessons.course.cli`)."""
from lessons.course.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
