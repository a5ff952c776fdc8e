"""The fold and its oracle: the state (m, l, o) with absorb/merge/finalize, the textbook
reference that shares no code with it, the trace a schedule records, and input checks.
Nothing here imports from the rest of the package."""
