"""The swarm simulator: thousands of virtual peers on virtual time, running the node's
pairing, outer optimizers, aggregators and message encoders (docs/simulator.md).

scenario.py (the TOML file), swarm.py (the discrete-event run), gossip.py (gossipsub's mesh
and floods), sizes.py (bytes from the real encoders), experiments.py (checkpoint bursts,
sybils), bench.py (`node bench sim`).
"""
