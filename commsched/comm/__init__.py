"""Communication: what goes on the wire for a partition, and commsched's own messages.

The transport interface (`transport`) and the all-reduce transport
(`allreduce`), the heartbeat that names a lost rank (`heartbeat`), commsched's
side process groups (`side_groups`), and the checks that every rank starts from
the same model and setup (`agreement`). The parameter-server transport lives
with its backend, in `commsched.ps`.
"""
