"""commsched's own process groups beside the user's: control messages and buffer broadcasts.

[Note: control messages] Besides gradients, commsched exchanges a few small
messages: the agreement on model and setup at ``prepare()``, the parameter
order after the first forward pass, the cost model's choice and the plan at
the end of warm-up. They are decided and read on the host. On a group with a
CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``) they go on that group. A group
without one (NCCL, which takes only CUDA tensors) gets its side group (below),
which has a gloo backend, rather than CUDA copies of the messages, because:

- the values are needed on the host at once; on the GPU each exchange would
  cost a copy each way and a stream synchronisation;
- a gloo wait honours its timeout on the host, so a peer that never answers
  gives a `CommunicationTimeout` naming what was awaited, where an NCCL
  message would queue behind the gradients' collectives on their stream.

What the side group must not do is measure the link the gradients use: the
latency probe and the link calibration (`commsched.planning.plans`) run on the
user's group, with tensors on the gradients' device.

[Note: side groups] One group per user group, over the same ranks, made at the
first ``prepare()`` that needs it and shared by every model prepared on that
group. It carries the control messages where the user's group takes no CPU
tensors, and the buffer broadcasts (and Join's counts) with forward overlap,
which must not queue behind gradient reductions still in flight. Its backend
is the user group's, with gloo for CPU tensors added where that backend lacks
it (``"cpu:gloo,cuda:nccl"`` for NCCL): one group serves both roles. Why one,
made once:

- A sub-group's other processes never call ``prepare()``, so its side group is
  made with ``use_local_synchronization=True``, and torch names such a group
  by its ranks alone: a second group over the same ranks would wait forever
  for a rendezvous that already happened. Torch (2.13, gloo) also makes such
  a group only where its ranks have made the same groups before: after
  ``new_group([0, 1])``, a local group over ranks 0, 1 and 2 waits forever.
  So a group of every process of the job gets ``new_group`` over all of
  them, as the default group does: only true sub-groups need local
  synchronisation.
- Every use is on the training thread, in program order, so models sharing it
  issue their operations in the same order on every rank.

After a communication failure the side group is abandoned (see [Note: exit
after a failure] in commsched/errors.py) and forgotten, so a later
``prepare()`` makes a new one.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterable

import torch.distributed as dist


def device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """The device types ``group``'s backend takes tensors on (``"cpu:gloo,cuda:nccl"``: both)."""
    return backend_device_types(str(dist.get_backend(group)))


def backend_device_types(backend: str) -> frozenset[str]:
    """The device types ``backend`` (as `dist.get_backend` spells it) takes tensors on."""
    if ":" in backend:
        return frozenset(pair.split(":", 1)[0].strip() for pair in backend.split(","))
    return frozenset(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def takes_cpu_tensors(group: dist.ProcessGroup) -> bool:
    return "cpu" in device_types(group)


def control_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself if it takes CPU tensors, else its side group.

    Collective over ``group``'s ranks when the side group is made.
    """
    if takes_cpu_tensors(group):
        return group
    return side_group_for(group)


_SIDE_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
"""Side groups by user group: see [Note: side groups]. An entry goes with its user group, when
a model lets go of its groups after the user destroyed that group (`forget_destroyed`), and at
exit, while threads can still run: the cache must never be what holds a group until the
interpreter finalizes (see [Note: process groups at exit] in commsched/engine/groups.py)."""
atexit.register(_SIDE_GROUPS.clear)  # after every reducer's own exit handler (registered later)


def side_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group``'s side group (see [Note: side groups]), made at the first call.

    Collective when made: over every process of the job for a group of them
    all, over ``group``'s ranks for a sub-group.
    """
    if group not in _SIDE_GROUPS:
        backend = side_group_backend(str(dist.get_backend(group)))
        if dist.get_world_size(group) == dist.get_world_size():  # every process of the job is in it
            _SIDE_GROUPS[group] = dist.new_group(backend=backend)
        else:
            _SIDE_GROUPS[group] = dist.new_group(
                dist.get_process_group_ranks(group), backend=backend, use_local_synchronization=True
            )
    return _SIDE_GROUPS[group]


_PARAMETER_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
"""The all-gathers of sharded optimizer state, by user group: one group per user group, made at the
first ``prepare()`` that shards and shared by every model prepared on it (torch never frees a
group, so one per model would pile up). Models share it safely: each issues its all-gathers on the
training thread, in program order, the same on every rank. Let go of as the side groups are."""
atexit.register(_PARAMETER_GROUPS.clear)


def parameter_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group of its own over ``group``'s ranks, with its backend, for the all-gathers of updated
    parameters (`commsched.update.sharded`), made at the first call as side groups are (see
    [Note: side groups]); collective when made."""
    return _own_group(_PARAMETER_GROUPS, group)


_EXCHANGE_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
"""The second steps of two-step all-reduces, by user group: issued from completions, they need an
order of their own (see [Note: an all-reduce in two steps] in `commsched.comm.two_step`). One per
user group, shared by the models prepared on it, as `_PARAMETER_GROUPS` is: one queue per group
(`SecondSteps.of_group`) issues them in the order of their first steps, which every model issues
in program order."""
atexit.register(_EXCHANGE_GROUPS.clear)


def exchange_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group of its own over ``group``'s ranks, with its backend, for the second steps of
    two-step all-reduces, made at the first call as side groups are; collective when made."""
    return _own_group(_EXCHANGE_GROUPS, group)


def _own_group(cache: weakref.WeakKeyDictionary, group: dist.ProcessGroup) -> dist.ProcessGroup:
    if group not in cache:
        backend = str(dist.get_backend(group))
        if dist.get_world_size(group) == dist.get_world_size():
            cache[group] = dist.new_group(backend=backend)
        else:
            cache[group] = dist.new_group(
                dist.get_process_group_ranks(group), backend=backend, use_local_synchronization=True
            )
    return cache[group]


def side_group_backend(backend: str) -> str:
    """``backend`` (a user group's), with gloo added for CPU tensors where it has none."""
    devices = backend_device_types(backend)
    if "cpu" in devices:
        return backend
    pairs = backend.split(",") if ":" in backend else [f"{device}:{backend}" for device in sorted(devices)]
    return ",".join(["cpu:gloo", *pairs])


def forget_destroyed() -> None:
    """Drop the side groups of user groups torch no longer knows (``destroy_process_group``).

    Called when a model lets go of its groups: torch keeps a destroyed group's object alive,
    so the weak key alone would keep its side group, and the side group's threads, running.
    """
    for cache in (_SIDE_GROUPS, _PARAMETER_GROUPS, _EXCHANGE_GROUPS):
        for user_group in list(cache):
            try:
                dist.get_process_group_ranks(user_group)
            except (KeyError, ValueError, RuntimeError):
                del cache[user_group]


def forget_side_groups(groups: Iterable[dist.ProcessGroup | None]) -> None:
    """After a failure: later ``prepare()`` calls make new side groups instead of using ``groups``."""
    dropped = {id(group) for group in groups if group is not None}
    for cache in (_SIDE_GROUPS, _PARAMETER_GROUPS, _EXCHANGE_GROUPS):
        for user_group, side in list(cache.items()):
            if id(side) in dropped:
                del cache[user_group]


def destroy_own_groups(groups: Iterable[dist.ProcessGroup | None]) -> None:
    """[Note: groups a model made for itself] torch keeps every group ``new_group`` made, with its
    threads, until ``destroy_process_group`` names it (or destroys them all): dropping the last
    reference frees nothing. A group made for one model alone (a parameter-server job's) is
    destroyed when the model, or its server, is done with it; else each ``prepare()`` would
    leave its groups' threads running to the end of the process, to be freed only at the
    interpreter's finalization. Local: it waits for no peer. Never for a group after a
    failure, which is abandoned instead (see [Note: exit after a failure] in commsched/errors.py)."""
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            dist.destroy_process_group(group)
        except ValueError:  # torch no longer knows it: the script destroyed every group
            pass
