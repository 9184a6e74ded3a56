"""A model's and a link's measured costs: the `Profile` data (`profile`) and how to measure one (`model`, `link`).

What ``commsched plan``, the simulator and the auto-tuner's first guesses replay.
"""
