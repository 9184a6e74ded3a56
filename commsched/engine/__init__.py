"""The engine: one `GradientReducer` per prepared model, and what each iteration runs.

From a gradient hook to the wire, from the wire to an update, from an update to
the next forward pass. The reducer (`reducer.py`) coordinates; each phase or job
is an object it owns and drops when that phase ends: the hooks, the warm-up, the
tuning session, the backward pass of each iteration, the forward gates, the
buffer broadcasts, Join's shadow iterations, the shutdown. See
docs/architecture.md.
"""
