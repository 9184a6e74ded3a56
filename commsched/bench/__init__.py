"""Tooling around commsched: the emulated cluster (`cluster`), the benchmark
models (`models`), the systems compared (`systems`) and the side-by-side
comparison (`compare`), the ``commsched bench`` grid (`grid`) and its loopback
counterpart (`loopback`), the ``commsched demo`` (`demo`), ``commsched trace-report``
(`trace_report`), and what the scripts in ``benchmarks/`` share: their options, runs
and JSON (`runner`) and their medians and ratios over repeats (`repeats`).

The library never imports this package, so training jobs load none of it.
"""
