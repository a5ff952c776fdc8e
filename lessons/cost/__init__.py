"""What a schedule costs: HBM bytes and FLOPs counted from the schedule (``traffic``), tensor
sizes (``sizes``), measured peak memory (``memory``) and how often lazy rescaling still rescales
(``rescale``)."""
