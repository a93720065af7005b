"""ds3d's control plane: the per-node daemon `ds3dd` (main.py, server.py), its gRPC API (api.py,
contract in protos/ds3d/v1/control.proto), the job state machine (states.py) and store
(store.py), one supervisor per job (supervisor.py, detectors.py, policies.py), the elastic agent
and rendezvous processes it starts (launcher.py, agent.py, rendezvous.py), and `ds3dctl`
(cli.py). Importing this package imports nothing heavy: torch is loaded only inside the agent
and rendezvous processes.
"""
