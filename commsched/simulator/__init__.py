"""The simulator: a model's profile, a cluster of N workers and a system in, its iteration time out.

Pure logic, no process group: what `commsched plan` and the tuner ask before a
run, for clusters larger than the one at hand.

[Note: the simulator] Workers are symmetric, so one worker's computation is
simulated beside the link(s) every worker shares; the iteration is the time
from one forward pass's start to the next one's, after a few iterations (the
forward pass waits for what the previous iteration left in flight, so the
first iteration is not the steady state).

*Collectives* (`Cluster`), for n bytes among N workers at link rate B, per-hop
latency alpha and a fixed host cost h per collective (Python, the gloo or NCCL
launch):
- ring all-reduce: 2(N-1) alpha + 2(N-1)/N n/B + h. A reduce-scatter and an
  all-gather, N-1 steps each, each step one hop and 1/N of the data.
- tree all-reduce (NCCL's double binary tree): 2 ceil(log2 N) alpha + 2 n/B + h.
  The data goes up a tree (reduce) and down it (broadcast), log2 N hops each
  way; pipelined in chunks, so the depth costs latency only. Each of the two
  trees carries half the data, and a node is inner in one and a leaf in the
  other, so its link carries about n in each phase: 2 n/B, slightly worse
  than the ring's bandwidth term but with latency logarithmic rather than
  linear in N, which is why it wins for small messages at large N.
- parameter servers (S servers): a block of n bytes lives on one server, whose
  link takes every worker's push (N n bytes in) and sends every worker the new
  values (N n out), full duplex: N n/B + 2 alpha + h. Blocks are placed as the
  parameter-server backend places them (largest first onto the least loaded
  server), and each server link is its own resource, so blocks of different
  servers proceed in parallel. The server's update of a block (``update_s`` by
  the block's bytes) delays that block's completion, not its link. ``mode="async"``
  is simulated as ``"sync"``: with symmetric workers they take the same time.
- collectives at once: an all-reduce link runs up to ``in_flight`` at once
  (gloo 2, NCCL 1), taking turns step by step: a round of their ring steps lasts
  the longest one's step alone or all their chunks on the wire, whichever is
  more; see [Note: two collectives at once] in `commsched.planning.wire`.
  Parameter servers' links carry one at a time.

*Computation*, per iteration: the forward pass reads parameter p first at
``first_use_s``; the backward pass makes gradient p ready at ``ready_s`` and
ends at ``backward_s`` (or the last gradient); the update takes ``update_s``,
split over buckets by bytes for commsched's per-bucket updates. Computation
that runs while a collective is on the wire takes ``1 + compute_slowdown`` times
as long (the host's cores and memory bandwidth are shared); and a collective
issued while the worker computes (not while it waits for the link) takes
``1 + collective_slowdown`` times as long on the wire, the other side of the
same sharing, which matters where the transport itself needs the host's cores
(gloo over TCP; hardly NCCL). Both are measured by
`commsched.profiling.link.measure_link`. A collective is stretched whole, as issued:
a simplification that overstates it where computation ends while it is on the
wire.

*Systems*:
- torch DDP (`DDPConfig`): buckets by its caps in reverse forward order, each
  all-reduced first in, first out when its last gradient is ready; at the end
  of backward the worker waits for every reduction, steps the optimizer, then
  runs the next forward pass.
- commsched (`Strategy`): `commsched.layout.buckets.bucket_layout` with the strategy's
  limits, `commsched.layout.partitions.make_partitions` with its partition size, the
  bucket holding the forward pass's first parameter ready only at the end of
  backward (it carries the usage flags), and partitions issued most urgent first
  (or first in, first out without ``priority``) under the credit window, by the
  rules of `commsched.layout.partitions.simulate_schedule` (a partition larger than the
  window goes alone; once every bucket is ready the window no longer limits).
  Issuing is dynamic: the plan the runtime agrees on is this same replay on
  rank 0's timeline. With ``overlap_forward`` the next forward pass waits, where
  it first reads a bucket's parameter, for that bucket's reduction and then
  runs its update; without, the worker waits after backward for each bucket in
  turn and updates it (as ``step()`` does: updates of finished buckets run while
  later ones are on the wire, which torch DDP's single step cannot).
  Partitions still on the wire when the next pass issues its own keep the link
  busy: the link is one resource across iterations. A Strategy is taken
  literally (``adaptive`` does not apply).
"""

from __future__ import annotations

from commsched.simulator.cluster import Cluster
from commsched.simulator.engine import bound_s, sharded_bound_s, simulate
from commsched.simulator.search import best_strategy, strategy_space
from commsched.simulator.spec import DDPConfig, SimResult, meta_parameters

__all__ = [
    "Cluster", "DDPConfig", "SimResult", "best_strategy", "bound_s", "meta_parameters", "sharded_bound_s", "simulate",
    "strategy_space",
]
