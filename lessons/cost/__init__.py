"""What a schedule costs: HBM bytes and FLOPs counted from the schedule (``traffic``), tensor
sizes (``sizes``), measured peak memory (``memory``), how often lazy rescaling still rescales
(``rescale``), the shared-memory bytes a warp reads per tensor-core product (``fragments``), the
shared loads per FMA of a register-tiled CUDA-core thread (``register_tiles``) and a decode lane
group's loads in flight with and without prefetch (``latency``)."""
