"""Requests from rank 0 to ranks 1..N-1 of a torchrun job, over the gloo control group.

Why not ``dist.scatter_object_list``: it hands tensors that have Python objects to gloo's
worker thread, and that thread frees them a moment *after* the call has returned. When the
call is the last one before the interpreter finalises (the exit message sent from an
``atexit`` hook), freeing them needs the GIL, which a non-Python thread cannot take during
finalisation: CPython ends the thread, and ending a C++ thread that way aborts the process
("terminate called without an active exception", or a segmentation fault). A core dump of
rank 0 showed exactly this stack (``ProcessGroupGloo::runLoop`` -> ``~AsyncScatterWork`` ->
``THPVariable_dealloc`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``), in about
one torchrun launch in six on a loaded 2-core machine.

Here rank 0 sends asynchronously and holds the work handle, which owns the tensors, so the
worker thread never frees them. The handles of the last message are kept to the end of the
process (:func:`keep_last_message_alive`), so freeing them never races finalisation.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

#: Work handles and tensors of the latest message rank 0 sent (see the module docstring).
_last_message: tuple = ()


def send(objects: list, group: dist.ProcessGroup | None) -> Any:
    """Rank 0: give ``objects[r]`` to rank r (r >= 1); return ``objects[0]`` (rank 0's own share)."""
    global _last_message
    payloads = [pickle.dumps(obj) for obj in objects]
    sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    width = int(sizes.max())
    buffers = [torch.frombuffer(bytearray(p.ljust(width, b"\0")), dtype=torch.uint8) for p in payloads]
    own = torch.empty(width, dtype=torch.uint8)
    works = [dist.broadcast(sizes, src=0, group=group, async_op=True)]
    works.append(dist.scatter(own, scatter_list=buffers, src=0, group=group, async_op=True))
    _last_message = (works, sizes, buffers, own)
    for work in works:
        work.wait()
    return objects[0]


def receive(group: dist.ProcessGroup | None) -> Any:
    """Ranks != 0: the object rank 0 sent to this rank with :func:`send`."""
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    dist.broadcast(sizes, src=0, group=group)
    out = torch.empty(int(sizes.max()), dtype=torch.uint8)
    dist.scatter(out, scatter_list=None, src=0, group=group)
    size = int(sizes[dist.get_rank(group)])
    return pickle.loads(out[:size].numpy().tobytes())


def keep_last_message_alive() -> None:
    """Rank 0 at exit: never free the last message's handles (see the module docstring)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_last_message))
