"""One module per schedule of the fold: which tiles are absorbed in which order, and which
partial states are merged. Each imports only ``lessons.core`` (and other schedules)."""
