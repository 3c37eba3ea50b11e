"""A stand-in for the probe child, for what cannot happen on a CPU machine.

It speaks the runner's protocol (protocol.py: die with the parent, print the ready line,
read one `ProbeRequest`) and then does what FAKE_MODE says: print the real CUDA OOM text
(`cuda_oom`; `cuda_oom_capped` as under a per-process cap) and exit, hang, be SIGKILLed,
segfault, print garbage, write a result file that is not JSON, or hold a timed phase (`timed`: announce it, wait for the go-ahead, sleep FAKE_TIMED_S).
FAKE_IMPORT_S makes its "imports" take that long before it is ready.
"""

import json
import os
import signal
import sys
import time

from autofit.protocol import PARENT_ENV, READY, TIMED_END, TIMED_START, die_with_parent

CUDA_OOM = """Traceback (most recent call last):
  File "train.py", line 12, in <module>
    loss.backward()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 39.38 GiB of which 1.50 GiB is free. Including non-PyTorch memory, this process has 37.86 GiB memory in use. Of the allocated memory 35.20 GiB is allocated by PyTorch, and 1.91 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""
# Under torch.cuda.set_per_process_memory_fraction (a --memory-limit on a GPU) the allocator adds
# "<cap> allowed; ", and the device's free memory no longer bounds anything (an H200 capped at 24 GiB).
CUDA_OOM_CAPPED = """torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 115.31 GiB is free. Including non-PyTorch memory, this process has 22.70 GiB memory in use. 23.40 GiB allowed; Of the allocated memory 21.05 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""

die_with_parent(int(os.environ[PARENT_ENV]) if os.environ.get(PARENT_ENV) else None)
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
