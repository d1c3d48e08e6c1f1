"""The pieces of ``benchmarks.bench_scale``: the state and target meshes, the save side, one
restoring host's measurement and the sample's summary, and the report."""
