"""dataplane.userspace"""
