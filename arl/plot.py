"""``python -m arl.plot RUN_DIR [RUN_DIR2 ...] [--out curves.png] [--x step|wall]``."""
from arl.metrics.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
