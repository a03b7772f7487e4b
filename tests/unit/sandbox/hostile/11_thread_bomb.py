"""Start threads until something gives."""
# expect: error timeout
import threading, time
while True:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
