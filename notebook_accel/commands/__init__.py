"""The `notebook-accel` command line."""
