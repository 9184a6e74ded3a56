"""The auto-tuner: which layout is fastest, found on measured iteration times of the real run.

Rank 0's `Controller` (pure logic) measures and decides, every rank applies
the broadcast `Decision` to its `TuningLog`; the engine's tuning session
(`commsched.engine.tuning`) runs the switch points.

[Note: auto-tuning] The cost model predicts; the run measures. With
``Strategy(autotune=True)``, after warm-up the run itself is the objective: a
*setting* (partition size, credit window, bucket caps, first bucket, forward
overlap) is tried for a few iterations, its median iteration time (from the
start of one synchronised backward pass to the next) is what it costs, and a
Bayesian optimiser (optuna's TPE sampler, seeded, ask/tell) proposes the next
setting to try from what it has seen. The first trial is the cost model's
choice, so a tuned run is never worse than what warm-up alone gives but for
the iterations spent measuring; the next few are the settings the simulator
(`commsched.simulator`) predicts fastest on the warm-up's timeline, so the
measurements start where the optimum most likely is. After ``autotune_iterations``
iterations the fastest settings are measured once more (`CONFIRM_BEST`) and the
fastest on that second measurement is adopted.

The protocol: settings change only at *switch points*, the start of a
synchronised backward pass whose number every rank knows (each `Decision`
says how many iterations away the next one is). There, rank 0 decides and
broadcasts; every rank lays out the new setting before that pass's state
exists; the iteration after a change is not measured (it pays for the new
layout, the new plan and the optimiser's state in new buckets).

[Note: drift] Once tuned, a window of `DRIFT_WINDOW` iterations is measured
between switch points; the first window after the best setting is adopted is
the baseline. If a later window's median differs from it by more than
`DRIFT_THRESHOLD`, up or down, a new study starts, seeded with the setting in
use (its window is its first measurement), then the first study's starting
point and the simulator's guesses again (on the old timeline, but reasonable
candidates on any link; a re-tune after a link change that measured only the
optimiser's proposals settled 12% above the new rate's best). Up: the link got slower or the
host busier, and finer partitions may now pay. Down too: a much faster link
(or less contention) moves the optimum towards fewer, larger collectives, and
the baseline no longer says what the setting costs. Noise within the threshold
never re-tunes: a median over a window ignores a few slow iterations (a
checkpoint, an evaluation).
"""
