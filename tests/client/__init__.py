"""Tests of the worker library (client/aggd_client); those that run it against the daemon's
user-space aggregator skip when the daemon package is not installed."""
