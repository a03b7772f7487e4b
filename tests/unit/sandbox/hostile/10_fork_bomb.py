"""A fork bomb: every process forks forever."""
# expect: timeout error
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
