"""Allocate and touch memory 16 MiB at a time until something gives."""
# expect: error
blocks = []
while True:
    blocks.append(bytearray(16 << 20))
