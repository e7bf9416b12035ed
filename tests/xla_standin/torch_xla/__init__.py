"""A stand-in for torch_xla, enough for notebook_accel's TPU launch path to run on a CPU machine:
only `torch_xla.distributed.xla_multiprocessing.spawn`. Tests put this folder on sys.path."""
