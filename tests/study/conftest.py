"""``studies/`` lies beside the library, not installed with it: import it from the repository root."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
