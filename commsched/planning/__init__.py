"""Choosing the layout and the order from measurements: calibration, the cost model, the plan.

At the end of warm-up rank 0 times the link (`calibration`), lets the cost
model pick the partitioning (`cost_model`), simulates priority scheduling on
its timeline (`schedule`) and publishes the choice and the plan (`plans`).
The auto-tuner (`commsched.tuning`) measures instead of predicting, and plans
each setting it tries the same way.
"""
