import sys
from pathlib import Path

# The pipeline tests' helpers and the coin-flip environment are importable as top-level modules
# (Ray actors find them through PYTHONPATH, set by the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
