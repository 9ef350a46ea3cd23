"""No rank waits forever: the watchdog (``watchdog.py``: the verdict, the process's
``enter``/``phase``/``watching``) built from the phase time limits (``phases.py``) and the
heartbeat store (``heartbeat.py``)."""
