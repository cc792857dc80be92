"""The `flywheel` command (`main.py`; `python -m app.cli` runs it too) and what it starts: the
whole stack in one process (`stack.py`), the demos (`demo.py`, `demo_loop.py`), the processes
of their own (`processes.py`: the online trainer's ranks, the bootstrap's)."""
