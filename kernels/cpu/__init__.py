"""pagedserve.kernels.cpu: the native CPU kernels (C files compiled once per machine and ISA tier by build.py, tiers in
isa.py and isa.h, ctypes mirrors of their structures in structs.py) and their Python entry points."""
