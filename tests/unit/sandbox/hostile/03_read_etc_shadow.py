"""Read the host's password files."""
# expect: ok
for path in ("/etc/shadow", "/etc/passwd", "/etc/hostname"):
    try:
        print("ESCAPED:", path, open(path).read()[:40])
    except OSError:
        pass
