"""PyTorch's own TCPStore server, for side-by-side benchmarks.

Run with the interpreter that has torch (Debian: /usr/bin/python3). Prints
"PORT PID" on one line, then serves until stdin closes or it is killed.
"""
import datetime
import os
import resource
import sys

import torch.distributed as dist

# The connect-storm benchmark opens tens of thousands of sockets.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0,
                      None, True, timeout=datetime.timedelta(seconds=600))
print(store.port, os.getpid(), flush=True)
sys.stdin.read()
