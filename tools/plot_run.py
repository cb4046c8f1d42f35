"""Training curves of a run in one PNG: `rollplex plot` (rollplex/plot.py), at the path commands written before it
use.

    python tools/plot_run.py runs/x                    # = rollplex plot runs/x: writes runs/x/curves.png
    python tools/plot_run.py runs/x --out /tmp/x.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
