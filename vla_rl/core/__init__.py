"""The ground floor of the vla-rl services: runtime pieces every layer above may use.

Above :mod:`vla_rl_client` (the contracts and robot-side clients) and below everything else: it imports
only :mod:`vla_rl_client` and the standard library. Holds the process lifeline (children exit with their
parent), CPU scheduling, secrets from the environment or files, console and structured logs, the seed
ranges, a supervisor's instance nonces and the version.
"""
