"""Spin the CPU forever."""
# expect: timeout
while True:
    pass
