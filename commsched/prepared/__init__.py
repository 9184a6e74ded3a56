"""What a prepared model and optimizer gain: the classes `commsched.prepare` mixes into theirs.

The user's own objects come back from ``prepare()``; these mixins give them
``no_sync()``, ``synchronize()``, state dicts and copies that wait for pending
updates, and the check on other optimizers stepping prepared parameters. Each
calls the model's reducer (`commsched.engine`) and nothing below it.
"""
