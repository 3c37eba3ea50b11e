"""The real CUDA out-of-memory texts the fake children print (what cannot happen on a CPU machine)."""

CUDA_OOM = """Traceback (most recent call last):
  File "train.py", line 12, in <module>
    loss.backward()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 39.38 GiB of which 1.50 GiB is free. Including non-PyTorch memory, this process has 37.86 GiB memory in use. Of the allocated memory 35.20 GiB is allocated by PyTorch, and 1.91 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""
# Under torch.cuda.set_per_process_memory_fraction (a --memory-limit on a GPU) the allocator adds
# "<cap> allowed; ", and the device's free memory no longer bounds anything (an H200 capped at 24 GiB).
CUDA_OOM_CAPPED = """torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 115.31 GiB is free. Including non-PyTorch memory, this process has 22.70 GiB memory in use. 23.40 GiB allowed; Of the allocated memory 21.05 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""
