import sys
from pathlib import Path

# The fault tests reuse the pipeline tests' recipes and the end-to-end tests' subprocess helpers; their
# fault-injecting environments (fault_envs.py) are importable as top-level modules, by Ray actors too
# (through PYTHONPATH, set by the tests).
HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "integration" / "pipeline", HERE.parent / "e2e"):
    sys.path.insert(0, str(path))
