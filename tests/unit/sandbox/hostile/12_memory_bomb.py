"""Allocate 64 GiB at once."""
# expect: error
block = bytearray(64 << 30)
print("ESCAPED: allocated", len(block))
