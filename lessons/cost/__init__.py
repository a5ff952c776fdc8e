"""What a schedule costs: HBM bytes and FLOPs counted from the schedule (``traffic``), tensor
sizes (``sizes``) and measured peak memory (``memory``)."""
