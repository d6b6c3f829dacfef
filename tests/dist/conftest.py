import sys
from pathlib import Path

# The harness module sits beside the tests; tests/ is not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
