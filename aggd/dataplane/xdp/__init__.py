"""dataplane.xdp"""
