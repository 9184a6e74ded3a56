"""Tooling around commsched: the emulated cluster (`cluster`), the benchmark
models (`models`), the systems compared (`systems`) and the side-by-side
comparison (`compare`), the ``commsched bench`` grid (`grid`), the
``commsched demo`` (`demo`) and ``commsched trace-report`` (`trace_report`).

The library never imports this package, so training jobs load none of it.
"""
