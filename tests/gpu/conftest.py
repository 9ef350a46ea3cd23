"""The GPU check is a script run by hand on a GPU machine; pytest never collects it."""

collect_ignore_glob = ["*.py"]
