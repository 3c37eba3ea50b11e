"""What is expected before measuring: the memory model (an analytic prior, fitted groups, out-of-memory
bounds) and each dimension's declared effect on speed.
"""
