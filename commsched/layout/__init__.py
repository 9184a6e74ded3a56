"""Where gradients live and in which order they travel: buckets, their flat buffers, partitions, the plan.

Plain data and pure logic, no process group. Built once per layout by the
engine, read by the transports, the updates and the planners.
"""
