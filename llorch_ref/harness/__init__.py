"""The checkpoint harness, the judge: one comparison of two dumps (compare.py), local teacher-forced ops
(local.py), the runs users ask for (run.py), metrics, results and proof bundles."""
