"""Real multi-process runs of the fold: ring attention over MPI ranks.

:mod:`lessons.distributed.ring` is the program each rank runs
(``mpiexec -n W python -m lessons.distributed.ring ...``); :mod:`lessons.distributed.launch`
starts it from Python with a time limit, finds ``mpiexec``, and reads back the results
folder. This layer imports only :mod:`lessons.core` and :mod:`lessons.schedules`, and,
for the ring's ``--device gpu|emulator`` folds only, the CUDA kernel of :mod:`lessons.gpu`
(imported inside the ranks that use it); ``mpi4py`` is needed only inside the ranks
(``pip install -e ".[distributed]"``).
"""
from lessons.distributed.launch import (RingRun, RingRunError, compare_with_simulation, load_run, mpi_status,
                                        run_ring)

__all__ = ["run_ring", "load_run", "mpi_status", "compare_with_simulation", "RingRun", "RingRunError"]
