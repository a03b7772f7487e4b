"""Sleep far past the wall-clock limit."""
# expect: timeout
import time
time.sleep(3600)
