"""Linear-recurrence engines behind one function.

h_t = a_t * h_{t-1} + x_t, element-wise over channels, accumulated in float32.
Every recurrent layer (RG-LRU, CG-LRU, GateLoop) calls `linear_scan`; the
implementation is a keyword so kernels can be swapped without touching layers.
"""
from model.scan.engine import linear_scan

__all__ = ["linear_scan"]
