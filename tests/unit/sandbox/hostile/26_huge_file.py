"""Write one file larger than the file-size limit (the kernel stops it with SIGXFSZ)."""
# expect: error
with open("huge", "wb") as f:
    for _ in range(1 << 12):
        f.write(b"x" * (1 << 20))
print("ESCAPED: wrote 4 GiB")
