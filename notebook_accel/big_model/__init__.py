"""Inference of models larger than memory: build on meta, plan a device map, load, and stream
offloaded weights to where each block runs.

Dependencies point one way, top to bottom:
dispatch -> hooks -> read_ahead (-> staging) -> store -> pages for running offloaded blocks;
dispatch -> planner -> device_map -> tensors -> sizes for the plan, checked once in device_map;
dispatch -> loading (-> loading_ranks -> weights_files) -> device_map and store for the weights.
layerwise_casting and align sit on hooks and read_ahead.
accelerate's paths (`big_modeling`, `hooks`, `utils.modeling`, `utils.offload`, `utils`'s names)
re-export from here. Nothing is imported by this file: each module is imported by name.
"""
