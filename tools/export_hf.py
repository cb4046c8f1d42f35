"""Export a run's checkpoint as a Hugging Face folder: `rollplex export` (rollplex/export.py), at the path
commands written before it use.

    python tools/export_hf.py runs/my_run --out hf_model      # = rollplex export runs/my_run --out hf_model
    python tools/export_hf.py --help                          # every option
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.export import main  # noqa: E402

if __name__ == "__main__":
    main()
