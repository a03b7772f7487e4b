"""Write gigabytes to stderr."""
# expect: output_limit
import sys
chunk = "x" * (1 << 16)
for _ in range(1 << 15):
    sys.stderr.write(chunk)
