"""Fill the disk: many files in the scratch directory until writing fails; prints how much got written."""
# expect: ok
import os
written = 0
try:
    for i in range(1 << 20):
        with open(f"fill{i}", "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20))
                written += 1 << 20
except OSError:
    pass
print("WROTE", written)
