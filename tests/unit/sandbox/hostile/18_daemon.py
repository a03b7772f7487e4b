"""A daemon (double fork, new session) that tries to outlive the run, while the program exits at once."""
# expect: ok
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(3600)
    os._exit(0)
