"""Write gigabytes to stdout."""
# expect: output_limit
import sys
chunk = "x" * (1 << 16)
for _ in range(1 << 15):
    sys.stdout.write(chunk)
