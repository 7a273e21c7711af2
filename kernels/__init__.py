"""Attention kernels (Triton) and their plain-torch references.

Only launchers are exported; every function takes tensors and knows nothing about requests.
"""
