"""Linear-recurrence engines behind one function.

h_t = a_t * h_{t-1} + x_t, element-wise over channels, accumulated in float32.
Every recurrent layer (RG-LRU, CG-LRU, GateLoop) calls `linear_scan`; the
implementation is a keyword so kernels can be swapped without touching layers.
Under a mesh, the model calls `shard_mapped_linear_scan` where the partitioner cannot
split the scan itself (a Pallas kernel) or must not (time split over a `sequence` axis);
see `model.scan.sequence_parallel`.
"""
from model.scan.engine import linear_scan
from model.scan.engine import linear_scan_pairs
from model.scan.engine import resolve_impl
from model.scan.engine import ScanOptions
from model.scan.sequence_parallel import sequence_sharded_linear_scan
from model.scan.sequence_parallel import shard_mapped_linear_scan
from model.scan.sequence_parallel import shard_local_linear_scan

__all__ = ["linear_scan", "linear_scan_pairs", "resolve_impl", "ScanOptions",
           "sequence_sharded_linear_scan", "shard_local_linear_scan",
           "shard_mapped_linear_scan"]
