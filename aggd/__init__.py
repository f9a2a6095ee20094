"""aggd: in-kernel gradient aggregation (XDP data plane, daemon, aggctl)."""
__version__ = "0.1.0"
