"""A stand-in for the Tofino SDE's ``bfrt_grpc`` package (not installable here), for a daemon
process started with ``tests/p4/fake_sde`` on its PYTHONPATH: see client.py."""
