"""Update policies: where the optimizer runs and how a bucket gets its new values."""

from commsched.update.base import Hyperparameters, UpdatePolicy

__all__ = ["Hyperparameters", "UpdatePolicy"]
