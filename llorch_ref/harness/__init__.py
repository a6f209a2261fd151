"""The checkpoint harness: specs (data in checkpoints/), metrics, comparison runs, proof bundles."""
