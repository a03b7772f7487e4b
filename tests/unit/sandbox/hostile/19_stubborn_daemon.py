"""A daemon that ignores every catchable signal and keeps writing files, outliving its parent."""
# expect: ok
import os, signal, time
if os.fork() == 0:
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        with open("heartbeat", "w") as f:
            f.write(str(time.time()))
        time.sleep(0.1)
