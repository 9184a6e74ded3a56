"""Where commsched's own small messages go: a process group that takes CPU tensors.

[Note: control messages] Besides gradients, commsched exchanges a few small
messages: the agreement on model and setup at ``prepare()``, the parameter
order after the first forward pass, the cost model's choice and the plan at
the end of warm-up. They are decided and read on the host. On a group with a
CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``) they go on that group. A group
without one (NCCL, which takes only CUDA tensors) gets a gloo group over the
same ranks, made once at ``prepare()``, rather than CUDA copies of the
messages, because:

- the values are needed on the host at once; on the GPU each exchange would
  cost a copy each way and a stream synchronisation;
- a gloo wait honours its timeout on the host, so a peer that never answers
  gives a `CommunicationTimeout` naming what was awaited, where an NCCL
  message would queue behind the gradients' collectives on their stream;
- made with ``use_local_synchronization=True``, only the group's own ranks take
  part, so sub-groups (the data-parallel group of a device mesh) work too.

What the side group must not do is measure the link the gradients use: the
latency probe and the link calibration (`commsched.planning`) run on the
user's group, with tensors on the gradients' device.
"""

from __future__ import annotations

import torch.distributed as dist


def device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """The device types ``group``'s backend takes tensors on (``"cpu:gloo,cuda:nccl"``: both)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return frozenset(pair.split(":", 1)[0].strip() for pair in backend.split(","))
    return frozenset(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def takes_cpu_tensors(group: dist.ProcessGroup) -> bool:
    return "cpu" in device_types(group)


def control_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself if it takes CPU tensors, else a new gloo group over its ranks.

    Collective over ``group``'s ranks (only when a group is made).
    """
    if takes_cpu_tensors(group):
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)

