"""Raise its own hard resource limits."""
# expect: ok
import resource
for limit in (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE):
    try:
        resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("ESCAPED: raised", limit)
    except (ValueError, OSError):
        pass
