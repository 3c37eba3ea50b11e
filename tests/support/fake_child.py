"""A stand-in for the probe child, for what cannot happen on a CPU machine.

It speaks the runner's protocol (protocol.py: die with the parent, print the ready line,
read one `ProbeRequest`) and then does what FAKE_MODE says: print the real CUDA OOM text
(`cuda_oom`; `cuda_oom_capped` as under a per-process cap) and exit, hang, be SIGKILLed,
segfault, print garbage, write a result file that is not JSON, or hold a timed phase (`timed`: announce it,
wait for the go-ahead, sleep FAKE_TIMED_S).
FAKE_IMPORT_S makes its "imports" take that long before it is ready.
"""

import json
import os
import signal
import sys
import time

from oom_text import CUDA_OOM, CUDA_OOM_CAPPED  # this folder is the script's first path

from autofit.protocol.request import READY, TIMED_END, TIMED_START, die_with_parent

die_with_parent()
mode = os.environ.get("FAKE_MODE", "hang")
time.sleep(float(os.environ.get("FAKE_IMPORT_S", "0")))
if mode == "garbage":
    print("\x00\x01 not the ready line {{{", flush=True)
print(READY, flush=True)
line = sys.stdin.readline()
if not line.strip():
    sys.exit(0)
req = json.loads(line)  # a ProbeRequest: the same field names as protocol.ProbeRequest
with open(os.path.join(os.path.dirname(req["result_path"]), "fake-child.pid"), "w") as f:
    f.write(str(os.getpid()))
if mode in ("cuda_oom", "cuda_oom_capped"):
    sys.stderr.write(CUDA_OOM if mode == "cuda_oom" else CUDA_OOM_CAPPED)
    sys.exit(1)
elif mode == "hang":
    time.sleep(3600)
elif mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "segfault":
    os.kill(os.getpid(), signal.SIGSEGV)
elif mode == "garbage":
    print("garbage on stdout after the request", flush=True)
    with open(req["result_path"], "w") as f:
        f.write("{not json")
    sys.exit(0)
elif mode == "host_oom_text":
    sys.stderr.write("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1234 bytes.\n")
    sys.exit(1)
elif mode == "timed":
    print(TIMED_START, flush=True)
    sys.stdin.readline()  # the runner's go-ahead
    time.sleep(float(os.environ.get("FAKE_TIMED_S", "2")))
    print(TIMED_END, flush=True)
    sys.stderr.write("timed phase over\n")
    sys.exit(1)
