"""Watching what the user's model and loop do, and refusing what would make training wrong.

The first forward pass's order and early reads (`first_forward`), reads outside
the forward pass (`reads`), the torch-function mode both use (`parameter_use`),
where the autograd engine is (`autograd_context`), changes to the parameters
after ``prepare()`` (`fingerprint`), and the errors that name misuse and its fix
(`guards`).
"""
