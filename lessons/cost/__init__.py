"""What a schedule costs: HBM bytes and FLOPs counted from the schedule (``traffic``), tensor
sizes (``sizes``), measured peak memory (``memory``), how often lazy rescaling still rescales
(``rescale``) and the shared-memory bytes a warp reads per tensor-core product (``fragments``)."""
