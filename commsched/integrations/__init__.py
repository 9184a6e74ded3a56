"""Adoption without rewriting: torch DDP's own interface, PyTorch Lightning, Hugging Face.

Each module here imports its framework; none is imported by ``import commsched``
except `commsched.integrations.ddp`, which needs torch alone.
"""
