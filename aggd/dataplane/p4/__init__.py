"""dataplane.p4"""
