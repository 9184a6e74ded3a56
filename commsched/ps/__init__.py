"""The parameter-server backend, both sides: the workers' transport and update policy, the servers.

``Strategy(backend=ParameterServer(num_servers=S))``: the last S ranks of the
world serve, the others train. See docs/parameter_server.md for the protocol
and its limits.
"""

from commsched.ps.roles import PSRoles, is_server_rank, server_ranks

__all__ = ["PSRoles", "is_server_rank", "server_ranks"]
