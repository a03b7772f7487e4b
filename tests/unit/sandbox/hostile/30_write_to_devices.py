"""Write to the device and kernel interfaces: /dev/shm (an unbounded tmpfs if writable), /proc/sys, /sys."""
# expect: ok
for path in ("/dev/shm/escaped", "/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "/sys/kernel/escaped",
             "/dev/escaped"):
    try:
        with open(path, "w") as f:
            f.write("x")
        print("ESCAPED: wrote", path)
    except OSError:
        pass
